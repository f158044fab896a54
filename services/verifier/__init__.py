"""The verifier service."""
