"""What the three services share: model, loading, tree and acceptance bookkeeping, tensors."""
