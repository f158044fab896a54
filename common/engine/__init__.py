"""The engine boundary: services talk to these protocols only, so a TensorRT backend can replace the
PyTorch one without touching them."""
