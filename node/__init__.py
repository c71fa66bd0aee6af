"""The adapter-fabric node: a gRPC service process over the fabric library."""
