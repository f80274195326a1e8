"""What a local arm runs, built from its settings: the backend, the scheduler config, the
serving limits. Each is read from the settings by field name, so a setting named like a
`SchedulerConfig` field, a `ServingOptions` field or a `TorchBackend` argument reaches it
with no code here (add the field to gateway/settings/groups.py and that is all).

Torch is imported only in `load_backend`, only when a torch arm is asked for
(tests/test_layering.py holds the gateway to that).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.settings.load import Settings
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig

T = TypeVar("T")


def by_field_name(cls: type[T], settings: Settings, **extra: Any) -> T:
    """A `cls` dataclass whose fields take the settings of the same name."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {name: getattr(settings, name) for name in names if hasattr(settings, name)}
    return cls(**{**values, **extra})


def call_by_name(fn: Callable[..., T], settings: Settings, *args: Any) -> T:
    """`fn(*args, **kwargs)` with every keyword parameter of `fn` that names a setting."""
    params = inspect.signature(fn).parameters
    kwargs = {
        name: getattr(settings, name)
        for name, param in params.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY and hasattr(settings, name)
    }
    return fn(*args, **kwargs)


def scheduler_config(settings: Settings) -> SchedulerConfig:
    return by_field_name(SchedulerConfig, settings)


def serving_options(settings: Settings) -> ServingOptions:
    return by_field_name(ServingOptions, settings)


class SharedWeights:
    """Loads (model, tokenizer) once for every torch arm of a deployment."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None

    def get(self) -> tuple[Any, Any]:
        with self._lock:
            if self._loaded is None:
                self._loaded = load_weights(self._settings)
            return self._loaded


def load_weights(settings: Settings) -> tuple[Any, Any]:
    """(HF model, tokenizer) as the settings name them (torch imported here, lazily)."""
    return _torch_modules().load_weights(settings.model, settings.device, settings.dtype)


def load_backend(settings: Settings, weights: SharedWeights | None = None) -> Backend:
    """The backend `settings` name; torch is imported only here, only when asked for.

    Torch backends built with the same `weights` share one copy of the model. The torch
    backend's keyword arguments are the settings of the same names.
    """
    if settings.backend == "sim":
        return SimBackend(
            num_blocks=settings.sim_num_blocks,
            block_size=settings.block_size,
            max_model_len=settings.max_model_len or settings.sim_max_model_len,
            time_scale=settings.sim_time_scale,
        )
    torch_backend = _torch_modules()

    def build() -> Backend:
        if settings.tensor_parallel_size > 1:  # its ranks load their own shards, not `weights`
            return call_by_name(torch_backend.TensorParallelBackend.load, settings, settings.model)
        model, tokenizer = (weights or SharedWeights(settings)).get()
        return call_by_name(torch_backend.TorchBackend, settings, model, tokenizer)

    # NOTE: loading runs OpenMP ops; a thread that exits takes its OpenMP pool with it, so
    # the engine's device thread keeps the only one (backends/torch/device_thread.py)
    return torch_backend.call_on_own_thread(build, "carousel-load")


def _torch_modules() -> Any:
    """backends.torch.api: the torch backend's entry points, imported on first use."""
    import backends.torch.api

    return backends.torch.api
