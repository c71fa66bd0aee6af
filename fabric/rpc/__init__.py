"""The gRPC edge shared by node and client: errors <-> status codes, TLS and tokens, per-peer limits."""
