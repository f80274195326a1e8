"""An arm that runs an Engine in this process (a torch model or the weight-free simulator)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from gateway.context import RequestContext
from gateway.deployment import Arm, Reply
from gateway.metrics import ArmGauges, GatewayMetrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving_chat import serve_chat
from gateway.serving_common import EngineRuntime, ServingOptions
from gateway.serving_completion import serve_completion
from gateway.settings import Settings
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.engine import Engine


class LocalArm(Arm):
    """A scheduler policy and a backend, driven by an Engine loop thread.

    `load_backend` runs on a worker thread in `start` (loading weights takes seconds); the
    engine's context window is `max_model_len` if given, else the backend's.
    """

    kind = "local"

    def __init__(
        self,
        name: str,
        load_backend: Callable[[], Backend],
        *,
        scheduler: str = "orca",
        config: SchedulerConfig | None = None,
        options: ServingOptions | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self._load_backend = load_backend
        self._config = config or SchedulerConfig()
        self._options = options or ServingOptions()
        self._max_model_len = max_model_len
        self._runtime: EngineRuntime | None = None
        self._loading = False
        self._load_error: str | None = None
        self._metrics: tuple[GatewayMetrics, str] | None = None

    @classmethod
    def from_backend(
        cls,
        backend: Backend,
        *,
        name: str | None = None,
        scheduler: str = "orca",
        config: SchedulerConfig | None = None,
        options: ServingOptions | None = None,
        max_model_len: int | None = None,
    ) -> LocalArm:
        """An arm over an already-built backend (tests, notebooks)."""
        return cls(
            name or scheduler,
            lambda: backend,
            scheduler=scheduler,
            config=config,
            options=options,
            max_model_len=max_model_len,
        )

    @property
    def engine(self) -> Engine:
        return self.runtime.engine

    @property
    def runtime(self) -> EngineRuntime:
        if self._runtime is None:
            raise RuntimeError(f"arm {self.name!r} has not started")
        return self._runtime

    async def start(self) -> None:
        self._loading = True
        try:
            backend = await asyncio.to_thread(self._load_backend)
            max_model_len = min(self._max_model_len or backend.max_model_len, backend.max_model_len)
            config = dataclasses.replace(self._config, max_model_len=max_model_len)
            engine = Engine(backend, self.scheduler, config, name=self.name)
            if self._metrics is not None:
                metrics, model = self._metrics
                metrics.watch_engine(engine, model, self.name)
            engine.start()
            self._runtime = EngineRuntime(engine, self._options, self.scheduler)
        except Exception as exc:
            self._load_error = f"loading failed: {exc}"
            raise
        finally:
            self._loading = False

    def bind_metrics(self, metrics: GatewayMetrics, model: str) -> None:
        self._metrics = (metrics, model)

    async def stop(self) -> None:
        if self._runtime is not None:
            engine = self._runtime.engine
            await asyncio.to_thread(engine.stop)
            engine.backend.close()

    @property
    def is_loading(self) -> bool:
        return self._loading or (self._runtime is None and self._load_error is None)

    @property
    def unavailable_reason(self) -> str | None:
        if self._load_error is not None:
            return self._load_error
        if self._runtime is None:
            return "the model is loading"
        engine = self._runtime.engine
        if not engine.is_alive:
            return engine.dead_reason or "the engine has stopped"
        return None

    @property
    def max_model_len(self) -> int | None:
        return None if self._runtime is None else self._runtime.max_model_len

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply:
        return await serve_chat(self.runtime, request, ctx)

    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Reply:
        return await serve_completion(self.runtime, request, ctx)

    def trace(self) -> dict[str, Any] | None:
        if self._runtime is None:
            return None
        engine = self._runtime.engine
        return {
            "kind": self.kind,
            "scheduler": self.scheduler,
            "max_num_seqs": engine.config.max_num_seqs,
            "iterations": [dataclasses.asdict(r) for r in list(engine.trace)],
        }

    def gauges(self, model: str) -> ArmGauges | None:
        if self._runtime is None:
            return None
        engine = self._runtime.engine
        return ArmGauges(model, self.name, engine.num_running, engine.num_waiting, engine.kv_usage)


# -- from settings --------------------------------------------------------------------------


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
                from backends.torch.runner import resolve_device, resolve_dtype

                device = resolve_device(self._settings.device)
                dtype = resolve_dtype(self._settings.dtype, device)
                self._loaded = load_model(self._settings.model, dtype=dtype)
            return self._loaded


def load_backend(settings: Settings, weights: SharedWeights | None = None) -> Backend:
    """The backend `settings` name; torch is imported only here, only when asked for.

    Torch backends built with the same `weights` share one copy of the model.
    """
    if settings.backend == "sim":
        from backends.sim import SimBackend

        return SimBackend(
            num_blocks=settings.sim_num_blocks,
            block_size=settings.block_size,
            max_model_len=settings.max_model_len or settings.sim_max_model_len,
            time_scale=settings.sim_time_scale,
        )
    from backends.torch.device_thread import call_on_own_thread
    from backends.torch.runner import TorchBackend

    def build() -> Backend:
        model, tokenizer = (weights or SharedWeights(settings)).get()
        return TorchBackend(
            model,
            tokenizer,
            device=settings.device,
            dtype=settings.dtype,
            kv_cache_gb=settings.kv_cache_gb,
            block_size=settings.block_size,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            prepack_weights=settings.prepack_weights,
        )

    # NOTE: loading runs OpenMP ops; a thread that exits takes its OpenMP pool with it, so
    # the engine thread's pool is the only one left (see backends/torch/device_thread.py)
    return call_on_own_thread(build, "carousel-load")


def scheduler_config(settings: Settings) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        batch_wait_ms=settings.batch_wait_ms,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        max_queue_wait_s=settings.max_queue_wait_s,
    )


def serving_options(settings: Settings) -> ServingOptions:
    return ServingOptions(
        default_max_tokens=settings.default_max_tokens,
        max_waiting_requests=settings.max_waiting_requests,
        retry_after_s=settings.retry_after_s,
        disconnect_poll_s=settings.disconnect_poll_s,
        max_prompt_tokens=settings.max_prompt_tokens,
    )
