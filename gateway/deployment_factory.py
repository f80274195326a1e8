"""Build a deployment from settings: one local arm from the flags, or the YAML `arms:`.

Local arms of the same deployment share one copy of the model weights (loaded once, on the
first arm's start); each has its own engine thread, KV cache and sampler. They then share
the device too: see docs/ab-testing.md for when a live split is a fair comparison.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from backends.base import Backend
from backends.upstream import UpstreamConfig
from gateway.arm_settings import ArmSettings
from gateway.deployment import Arm, Deployment
from gateway.local_arm import LocalArm, load_backend, scheduler_config, serving_options
from gateway.settings import Settings
from gateway.upstream_arm import UpstreamArm


class SharedWeights:
    """Loads (model, tokenizer) once for every torch arm of a deployment."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None

    def get(self) -> tuple[Any, Any]:
        with self._lock:
            if self._loaded is None:
                from backends.torch.loader import load_model

                self._loaded = load_model(self._settings.model)
            return self._loaded


def _torch_backend(settings: Settings, weights: SharedWeights) -> Backend:
    from backends.torch.runner import TorchBackend

    model, tokenizer = weights.get()
    return TorchBackend(
        model,
        tokenizer,
        device=settings.device,
        dtype=settings.dtype,
        kv_cache_gb=settings.kv_cache_gb,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
    )


def arm_settings(settings: Settings, arm: ArmSettings) -> Settings:
    """The top-level settings with a local arm's own knobs laid over them."""
    overrides = {
        key: value
        for key in (
            "scheduler",
            "backend",
            "max_num_seqs",
            "max_num_batched_tokens",
            "batch_wait_ms",
            "enable_chunked_prefill",
            "kv_cache_gb",
        )  # fmt: skip
        if (value := getattr(arm, key)) is not None
    }
    return settings.model_copy(update=overrides)


def local_arm(settings: Settings, name: str, weight: float, weights: SharedWeights) -> LocalArm:
    load: Callable[[], Backend]
    if settings.backend == "torch":
        load = lambda: _torch_backend(settings, weights)  # noqa: E731
    else:
        load = lambda: load_backend(settings)  # noqa: E731
    arm = LocalArm(
        name,
        load,
        scheduler=settings.scheduler,
        config=scheduler_config(settings),
        options=serving_options(settings),
        max_model_len=settings.max_model_len,
    )
    arm.weight = weight
    return arm


def upstream_arm(arm: ArmSettings) -> UpstreamArm:
    assert arm.upstream is not None
    up = arm.upstream
    config = UpstreamConfig(
        base_urls=tuple(up.base_urls),
        model=up.model,
        api_key=up.api_key,
        connect_timeout_s=up.connect_timeout_s,
        read_timeout_s=up.read_timeout_s,
        health_interval_s=up.health_interval_s,
        max_connections=up.max_connections,
        retries=up.retries,
    )
    return UpstreamArm(arm.name, config, arm.weight)


def deployment_from_settings(settings: Settings) -> Deployment:
    """The deployment `settings` describe, served as `settings.model_name`."""
    weights = SharedWeights(settings)
    if not settings.arms:
        return Deployment(
            settings.model_name, [local_arm(settings, settings.scheduler, 1.0, weights)]
        )
    arms: list[Arm] = []
    for arm in settings.arms:
        if arm.upstream is not None:
            arms.append(upstream_arm(arm))
        else:
            arms.append(local_arm(arm_settings(settings, arm), arm.name, arm.weight, weights))
    return Deployment(settings.model_name, arms)
