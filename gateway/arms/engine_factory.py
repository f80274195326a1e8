"""What a local arm runs, built from its settings: the backend, the scheduler config, the
serving limits. The scheduler config and the serving limits read the settings by field name
(a setting named like a `SchedulerConfig` or `ServingOptions` field reaches it with no code
here); the torch backend's `TorchBackendConfig` is built once here, field by field, and
handed down whole (tests/test_backend_config.py fails for a setting that reaches nothing).
A setting the chosen backend cannot honour is refused before anything loads
(`check_backend_settings`).

Torch is imported only in `load_backend`, only when a torch arm is asked for
(tests/test_layering.py holds the gateway to that).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, TypeVar

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.settings.groups import unhonoured_message
from gateway.settings.load import Settings
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.spec_decode.config import parse_speculative_config

T = TypeVar("T")


def by_field_name(cls: type[T], settings: Settings, **extra: Any) -> T:
    """A `cls` dataclass whose fields take the settings of the same name."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {name: getattr(settings, name) for name in names if hasattr(settings, name)}
    return cls(**{**values, **extra})


def check_backend_settings(settings: Settings) -> None:
    """Refuse, naming them, settings the arm's backend cannot honour (never ignore them)."""
    message = unhonoured_message(settings)
    if message:
        raise ValueError(message)


def torch_backend_config(settings: Settings) -> Any:
    """The `TorchBackendConfig` of `settings`: every torch setting, read in this one place.

    Torch is imported here (the config's package), only when a torch arm is built.
    """
    check_backend_settings(settings)
    return _torch_modules().TorchBackendConfig(
        model=settings.model,
        device=settings.device,
        dtype=settings.dtype,
        kv_cache_gb=settings.kv_cache_gb,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        prepack_weights=settings.prepack_weights,
        disable_hybrid_kv_cache_manager=settings.disable_hybrid_kv_cache_manager,
        attention_backend=settings.attention_backend,
        cpu_kernels=settings.cpu_kernels,
        kernels_in_background=settings.kernels_in_background,
        compile=settings.compile,
        enforce_eager=settings.enforce_eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        quantization=settings.quantization,
        quantization_max_rows=settings.quantization_max_rows,
        batch_invariant=settings.batch_invariant,
        model_impl=settings.model_impl,
    )


def sim_options(settings: Settings) -> dict[str, Any]:
    """The sim backend's keyword arguments, read from `settings` in this one place."""
    return {
        "num_blocks": settings.sim_num_blocks,
        "block_size": settings.block_size,
        "max_model_len": settings.max_model_len or settings.sim_max_model_len,
        "time_scale": settings.sim_time_scale,
    }


def scheduler_config(settings: Settings) -> SchedulerConfig:
    """The `SchedulerConfig` of `settings` (`speculative_config`'s JSON parsed: the settings
    checked it already)."""
    spec = parse_speculative_config(settings.speculative_config)
    return by_field_name(SchedulerConfig, settings, speculative_config=spec)


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
    return _torch_modules().load_weights(
        settings.model, settings.device, settings.dtype, settings.model_impl
    )


def load_backend(settings: Settings, weights: SharedWeights | None = None) -> Backend:
    """The backend `settings` name; torch is imported only here, only when asked for.

    Torch backends built with the same `weights` share one copy of the model; each gets
    the one `TorchBackendConfig` of `settings`.
    """
    check_backend_settings(settings)
    if settings.backend == "sim":
        return SimBackend(**sim_options(settings))
    torch_backend = _torch_modules()
    config = torch_backend_config(settings)

    def build() -> Backend:
        if config.tensor_parallel_size > 1:  # its ranks load their own shards, not `weights`
            return torch_backend.TensorParallelBackend.load(config)
        model, tokenizer = (weights or SharedWeights(settings)).get()
        return torch_backend.TorchBackend(model, tokenizer, config)

    # NOTE: loading runs OpenMP ops; a thread that exits takes its OpenMP pool with it, so
    # the engine's device thread keeps the only one (backends/torch/runner/device_thread.py)
    return torch_backend.call_on_own_thread(build, "carousel-load")


def _torch_modules() -> Any:
    """backends.torch.api: the torch backend's entry points, imported on first use."""
    import backends.torch.api

    return backends.torch.api
