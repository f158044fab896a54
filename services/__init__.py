"""The three gRPC services: gateway (public), draft, verifier."""
