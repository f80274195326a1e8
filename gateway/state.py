"""What the routes reach through `request.app.state.gateway`: the deployments, metrics and
stores, and the arms' start, drain and stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from starlette.types import Scope

from gateway.api.endpoint import Endpoint
from gateway.api.responses.store import MemoryResponseStore, ResponseStore
from gateway.api.table import BY_PATH, endpoint_table
from gateway.arms.arm import Arm
from gateway.arms.deployment import Deployments
from gateway.context import RequestContext
from gateway.http.middleware import Admission
from gateway.obs.metrics import GatewayMetrics
from gateway.obs.traffic_record import TrafficRecorder
from gateway.rollout.controller import RolloutController
from gateway.rollout.evidence import request_sample
from gateway.services import RequestServices
from gateway.settings.load import Settings
from gateway.settings.rollout_metrics import ERROR

log = structlog.get_logger("carousel.gateway")


def _freeze_gc() -> None:
    """Move every object alive now (the loaded model, tokenizer, modules) into the GC's
    permanent generation, as vLLM does after start-up: a full collection then walks only what
    requests allocate. Without it, a full collection walked the whole start-up heap: 0.35 s
    with the GIL held (the event loop and the engine's Python both stalled) every few thousand
    streamed tokens (docs/benchmarks/history/)."""
    began = time.monotonic()
    gc.collect()
    gc.freeze()
    log.info("gc_frozen", objects=gc.get_freeze_count(), seconds=round(time.monotonic() - began, 3))


def _log_kv_cache(model: str, arm: Arm) -> None:
    """Say what a started arm's KV cache holds, as vLLM's start-up log does (none: no local
    engine)."""
    gauges = arm.gauges(model)
    if gauges is not None and gauges.kv_capacity is not None:
        log.info("kv_cache", model=model, arm=arm.name, **gauges.kv_capacity.log_fields())


@dataclass
class GatewayState:
    """What the routes reach through `request.app.state.gateway`."""

    settings: Settings
    deployments: Deployments
    metrics: GatewayMetrics
    on_fatal: Callable[[], None] | None = None
    load_failed: bool = False
    #: once every arm is ready, freeze what the start-up allocated out of the cyclic GC (a
    #: server process: `carousel serve`); see `_freeze_gc`
    freeze_gc_when_ready: bool = False
    #: the traffic record (`--record-traffic`), None when off
    recorder: TrafficRecorder | None = None
    #: stored Responses API responses (`previous_response_id`, GET/DELETE /v1/responses/{id})
    response_store: ResponseStore = field(default_factory=MemoryResponseStore)
    admission: Admission = field(default_factory=Admission)
    #: each deployment's rollout (`rollout:`), by served name
    rollouts: dict[str, RolloutController] = field(default_factory=dict)
    #: some principal has `admin: true`: the admin routes are then for admins only
    admin_principals: bool = False
    _start_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _stop_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @functools.cached_property
    def endpoints(self) -> dict[str, Endpoint]:
        """The served endpoints by path, the Responses API's over this gateway's store."""
        return {endpoint.path: endpoint for endpoint in endpoint_table(self.response_store)}

    @property
    def services(self) -> RequestServices:
        """What the requests served now use (the metrics, the traffic record, the store)."""
        on_finished = self.observe_rollout if self.rollouts else None
        return RequestServices(self.metrics, self.recorder, self.response_store, on_finished)

    def observe_rollout(self, ctx: RequestContext, status: int, total_s: float) -> None:
        """A finished request of a rollout's arm is one more sample of its tests: of the arm
        the split drew for it. Drawn to an arm that could not serve it, it is that arm's
        error (whoever served it); pinned or continued, it is counted apart."""
        rollout = self.rollouts.get(ctx.model)
        if rollout is None or ctx.arm is None:
            return
        if ctx.arm_drawn is not None and ctx.arm_drawn != ctx.arm:
            rollout.observe(ctx.arm_drawn, {ERROR: 1.0}, ctx.user)
            return
        sample = request_sample(status, ctx.ttft_s, total_s, ctx.completion_tokens)
        rollout.observe(ctx.arm, sample, ctx.user, randomised=ctx.arm_drawn is not None)

    def start(self) -> None:
        for deployment, arm in self.deployments.arms():
            arm.bind_metrics(self.metrics, deployment.name)
        for deployment in self.deployments:
            for mirror in deployment.mirrors:
                mirror.start(self.metrics)
        self._start_task = asyncio.create_task(self._start_arms())

    async def _start_arms(self) -> None:
        for deployment, arm in self.deployments.arms():
            began = time.monotonic()
            try:
                await arm.start()
            except Exception as exc:
                self.load_failed = True
                log.error("arm_load_failed", model=deployment.name, arm=arm.name, error=str(exc))
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            _log_kv_cache(deployment.name, arm)
            log.info(
                "arm_ready",
                model=deployment.name,
                arm=arm.name,
                kind=arm.kind,
                load_s=round(time.monotonic() - began, 3),
            )
        if self.freeze_gc_when_ready:
            _freeze_gc()

    async def stop(self) -> None:
        """Stop every arm, once (later calls wait for the first); requests still in flight
        end with an error."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop_arms())
        await self._stop_task

    async def _stop_arms(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._start_task
        for deployment in self.deployments:
            for mirror in deployment.mirrors:
                await mirror.stop()
        for _, arm in self.deployments.arms():
            await arm.stop()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        await self.response_store.close()

    async def drain(self, timeout_s: float, grace_s: float = 2.0) -> None:
        """Refuse new requests (503), give those in flight `timeout_s` to finish, then stop
        the arms, which ends the rest with an error, and give those answers `grace_s`."""
        admission = self.admission
        admission.draining = True
        log.info("drain_started", in_flight=admission.in_flight, timeout_s=timeout_s)
        if await admission.wait_idle(timeout_s):
            log.info("drain_finished")
            return
        log.warning("drain_timeout", in_flight=admission.in_flight)
        await self.stop()
        if not await admission.wait_idle(grace_s):
            log.warning("drain_abandoned", in_flight=admission.in_flight)

    def record_refusal(self, scope: Scope, status: int, message: str) -> None:
        """Log (and, on the OpenAI endpoints, count) a request a middleware refused."""
        request_id = scope.get("state", {}).get("request_id", "")
        endpoint = BY_PATH.get(scope["path"])
        if endpoint is None:
            log.info("refused", path=scope["path"], status=status, request_id=request_id)
            return

        async def connected() -> bool:
            return False

        ctx = RequestContext(request_id, endpoint.name, "", connected)
        RequestServices(metrics=self.metrics).finish(ctx, status, message)
