"""PyTorch models: the Llama-family base and the EAGLE-3 draft head."""
