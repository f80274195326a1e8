"""An arm that runs an Engine in this process (a torch model or the weight-free simulator)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from pydantic import BaseModel

from gateway.api.endpoint import Endpoint, LocalPipeline, Reply
from gateway.api.pipeline import EngineRuntime, ServingOptions
from gateway.api.sampling_defaults import SamplingDefaults, sampling_defaults
from gateway.arms.arm import Arm
from gateway.context import RequestContext
from gateway.obs.kv_capacity import KVCapacity
from gateway.obs.metrics import ArmGauges, ArmInfo, GatewayMetrics, local_device_group
from gateway.services import RequestServices
from schedulers import defaults
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.engine import Engine
from schedulers.load_phase import current_load_phase

log = structlog.get_logger("carousel.gateway")


class LocalArm(Arm):
    """A scheduler policy and a backend, driven by an Engine loop thread.

    `load_backend` runs on a worker thread in `start` (loading weights takes seconds); the
    engine decides the context window (`config.max_model_len`, capped by the backend's).
    """

    kind = "local"

    def __init__(
        self,
        name: str,
        load_backend: Callable[[], Backend],
        *,
        scheduler: str = defaults.SCHEDULER,
        config: SchedulerConfig | None = None,
        policy_options: Mapping[str, Any] | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self._load_backend = load_backend
        self._config = config or SchedulerConfig()
        self._policy_options = dict(policy_options or {})
        self._options = options or ServingOptions()
        self._runtime: EngineRuntime | None = None
        #: each endpoint's pipeline over this arm's engine, built on its first request
        self._pipelines: dict[Endpoint, LocalPipeline] = {}
        self._loading = False
        self._load_error: str | None = None
        self._metrics: tuple[GatewayMetrics, str] | None = None

    @classmethod
    def from_backend(
        cls,
        backend: Backend,
        *,
        name: str | None = None,
        scheduler: str = defaults.SCHEDULER,
        config: SchedulerConfig | None = None,
        policy_options: Mapping[str, Any] | None = None,
        options: ServingOptions | None = None,
    ) -> LocalArm:
        """An arm over an already-built backend (tests, notebooks)."""
        return cls(
            name or scheduler,
            lambda: backend,
            scheduler=scheduler,
            config=config,
            policy_options=policy_options,
            options=options,
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
            choice = self._options.generation_config
            defaults = sampling_defaults(choice, backend.generation_config)
            log_sampling_defaults(self.name, choice, defaults)
            engine = Engine(
                backend,
                self.scheduler,
                self._config,
                policy_options=self._policy_options,
                name=self.name,
            )
            if self._metrics is not None:
                metrics, model = self._metrics
                metrics.watch_engine(engine, model, self.name)
            engine.start()
            self._runtime = EngineRuntime(engine, self._options, self.scheduler, defaults)
            self._pipelines = {}
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
            phase = current_load_phase() if self._loading else None
            if phase is None:
                return "the model is loading"
            return f"the model is loading: {phase.description} ({phase.elapsed_s:.0f} s so far)"
        engine = self._runtime.engine
        if not engine.is_alive:
            return engine.dead_reason or "the engine has stopped"
        return None

    @property
    def max_model_len(self) -> int | None:
        return None if self._runtime is None else self._runtime.max_model_len

    async def serve(
        self, endpoint: Endpoint, request: BaseModel, ctx: RequestContext, services: RequestServices
    ) -> Reply:
        pipeline = self._pipelines.get(endpoint)
        if pipeline is None:
            pipeline = self._pipelines[endpoint] = endpoint.local(self.runtime)
        return await pipeline(request, ctx)

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

    @property
    def serving_kernels(self) -> str | None:
        return None if self._runtime is None else self._runtime.engine.backend.serving_kernels

    def info(self, model: str) -> ArmInfo:
        return ArmInfo(model, self.name, self.kind, local_device_group())

    def gauges(self, model: str) -> ArmGauges | None:
        if self._runtime is None:
            return None
        engine = self._runtime.engine
        bm = engine.block_manager
        return ArmGauges(
            model,
            self.name,
            engine.num_running,
            engine.num_waiting,
            engine.kv_usage,
            bm.num_cached_blocks / bm.num_blocks,
            engine.backend.weight_bytes,
            KVCapacity.of(engine.backend.kv_cache_spec, engine.max_model_len),
            engine.backend.serving_kernels,
        )


def log_sampling_defaults(arm: str, choice: str, defaults: SamplingDefaults) -> None:
    """Say, once per arm, what a request's unset sampling fields become (vLLM warns the same
    when the model's generation config overrides its defaults)."""
    log.info(
        "sampling_defaults",
        arm=arm,
        generation_config=choice,
        source=defaults.source,
        **defaults.values(),
        **({"ignored_without_do_sample": list(defaults.ignored)} if defaults.ignored else {}),
    )
