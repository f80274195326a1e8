"""Tensor parallelism for the torch backend over torch.distributed (docs/parallelism.md)."""
