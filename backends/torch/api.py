"""The torch backend's entry points for the gateway, which imports this module lazily
(gateway/arms/engine_factory.py), only when a torch arm is asked for."""

from __future__ import annotations

from typing import Any

from backends.torch.config import TorchBackendConfig
from backends.torch.loader import checkpoint_dtype, load_model
from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.runner.backend import TorchBackend, resolve_device, resolve_dtype
from backends.torch.runner.device_thread import call_on_own_thread

__all__ = [
    "TensorParallelBackend",
    "TorchBackend",
    "TorchBackendConfig",
    "call_on_own_thread",
    "load_weights",
]


def load_weights(
    model: str, device: str | None, dtype: str | None, model_impl: str = "auto"
) -> tuple[Any, Any]:
    """(HF model, tokenizer) of `model`, in `dtype` (None or `auto`: see `auto_dtype`); a class
    `model_impl`'s path cannot run is refused before any weight is read."""
    target = resolve_device(device)
    auto = dtype in (None, "auto") and target.type == "cuda"  # NOTE: a CPU ignores the checkpoint
    checkpoint = checkpoint_dtype(model) if auto else None
    return load_model(model, dtype=resolve_dtype(dtype, target, checkpoint), model_impl=model_impl)
