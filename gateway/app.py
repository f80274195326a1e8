"""The FastAPI app factory and its lifespan (arms load in the background, stop with the app).

    app = create_app(Settings.load(), deployments=None)

Without `deployments`, one deployment is built from the settings (one local arm). While an
arm loads, /health and the OpenAI routes answer 503; a load failure is logged, keeps them at
503 and calls `state.on_fatal` (the CLI uses it to stop the server).

Shutdown (`GatewayServer`, docs/reliability.md): the first SIGTERM/SIGINT starts a drain:
the listener stays open and new requests get 503 `server_shutting_down`, requests in flight
get `drain_timeout_s` to finish, then the arms stop (which ends the rest with an error,
in-band for streams) and uvicorn closes the listener and exits. A second signal skips the
drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType

import structlog
import uvicorn
from fastapi import FastAPI
from starlette.types import Scope

from gateway import carousel_version
from gateway.auth import APIKeyMiddleware
from gateway.context import RequestContext
from gateway.deployment import Deployment, Deployments
from gateway.deployment_factory import deployment_from_settings
from gateway.endpoints import BY_PATH
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.middleware import (
    Admission,
    BodyLimitMiddleware,
    DrainMiddleware,
    RequestIdMiddleware,
)
from gateway.response_store import ResponseStore
from gateway.routes import router
from gateway.settings import Settings
from gateway.traffic_record import TrafficRecorder

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
    response_store: ResponseStore = field(default_factory=ResponseStore)
    admission: Admission = field(default_factory=Admission)
    _start_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _stop_task: asyncio.Task[None] | None = field(default=None, repr=False)

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

        ctx = RequestContext(request_id, endpoint.name, "", connected, metrics=self.metrics)
        ctx.finish(status, message)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: GatewayState = app.state.gateway
    state.start()
    try:
        yield
    finally:
        await state.stop()


def create_app(
    settings: Settings | None = None, deployments: Sequence[Deployment] | None = None
) -> FastAPI:
    """A Carousel app serving `deployments` (default: one built from `settings`)."""
    settings = settings or Settings.load()
    served = Deployments(deployments or [deployment_from_settings(settings)])
    app = FastAPI(title="Carousel", version=carousel_version(), lifespan=_lifespan)
    metrics = GatewayMetrics(served.gauges, served.infos)
    state = GatewayState(
        settings,
        served,
        metrics,
        recorder=traffic_recorder(settings),
        response_store=ResponseStore(settings.responses_store_size),
    )
    if state.recorder is not None:
        recorder = state.recorder
        metrics.watch_traffic_record(lambda: (recorder.written, recorder.dropped))
    app.state.gateway = state
    install_error_handlers(app)
    app.include_router(router)
    # NOTE: the last added runs first: request id -> drain -> API key -> body limit -> routes
    refused = state.record_refusal
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, on_refused=refused
    )
    open_paths = ("/health", "/metrics") if settings.metrics_open else ("/health",)
    app.add_middleware(
        APIKeyMiddleware, keys=settings.api_keys, open_paths=open_paths, on_refused=refused
    )
    app.add_middleware(
        DrainMiddleware,
        admission=state.admission,
        retry_after_s=settings.retry_after_s,
        on_refused=refused,
    )
    app.add_middleware(RequestIdMiddleware)
    return app


def traffic_recorder(settings: Settings) -> TrafficRecorder | None:
    """The traffic record `--record-traffic` asks for (None when off)."""
    if settings.record_traffic is None:
        return None
    return TrafficRecorder(
        settings.record_traffic,
        redact=settings.record_redact,
        max_bytes=settings.record_max_bytes,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM/SIGINT (see the module docstring).

    NOTE: uvicorn closes its listening socket only once `should_exit` is set, which here is
    after the drain: that is what lets new requests get a 503 instead of a refused connection.
    """

    def __init__(self, config: uvicorn.Config, state: GatewayState, drain_timeout_s: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._signalled = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then exit. Another: end what is in flight and exit now."""
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
        elif self._signalled:
            self._loop.call_soon_threadsafe(self._begin_stop)
            super().handle_exit(sig, frame)
        else:
            self._signalled = True
            self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        self._drain_task = asyncio.create_task(self._drain(sig))

    def _begin_stop(self) -> None:
        log.warning("drain_skipped", in_flight=self.state.admission.in_flight)
        self._stop_task = asyncio.create_task(self.state.stop())

    async def _drain(self, sig: int) -> None:
        try:
            await self.state.drain(self.drain_timeout_s)
        finally:
            super().handle_exit(sig, None)  # NOTE: as uvicorn: exit now, re-raise sig after
