"""For tests, benchmarks and demos only: real node processes on loopback, network namespaces, the demo.

The node's runtime path never imports this package."""
