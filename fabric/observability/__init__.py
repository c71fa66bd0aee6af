"""What a node tells its operator: Prometheus metrics, structured logs, and the plain-HTTP probe endpoint."""
