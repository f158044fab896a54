"""The draft service."""
