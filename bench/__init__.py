"""Benchmarks (in-process engines and the service stack)."""
