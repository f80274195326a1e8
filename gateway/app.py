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
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import FrameType

import structlog
import uvicorn
from fastapi import FastAPI

from gateway import carousel_version
from gateway.api.errors import install_error_handlers
from gateway.api.responses.redis_store import RedisResponseStore
from gateway.api.responses.store import MemoryResponseStore, ResponseStore
from gateway.arms.deployment import Deployment, Deployments
from gateway.arms.factory import deployment_from_settings
from gateway.http.auth import APIKeyMiddleware, KeyTable
from gateway.http.middleware import (
    BodyLimitMiddleware,
    DrainMiddleware,
    RequestIdMiddleware,
)
from gateway.http.routes import router
from gateway.obs.metrics import GatewayMetrics
from gateway.obs.traffic_record import TrafficRecorder
from gateway.rollout.controller import RolloutController, RolloutMetrics
from gateway.rollout.spec import build_spec, unsampled_notes
from gateway.rollout.store import open_store
from gateway.settings.load import Settings
from gateway.settings.principals import Principal
from gateway.state import GatewayState

log = structlog.get_logger("carousel.gateway")


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
    keys = settings.key_principals()
    state = GatewayState(
        settings,
        served,
        metrics,
        recorder=traffic_recorder(settings),
        response_store=response_store(settings, dict(_budgets(keys))),
    )
    if state.recorder is not None:
        recorder = state.recorder
        metrics.watch_traffic_record(lambda: (recorder.written, recorder.dropped))
    state.rollouts = rollouts(settings, served, metrics)
    state.admin_principals = any(principal.admin for _, principal in keys)
    app.state.gateway = state
    install_error_handlers(app)
    app.include_router(router)
    # NOTE: the last added runs first: request id -> drain -> API key -> body limit -> routes
    refused = state.record_refusal
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, on_refused=refused
    )
    metrics_open = settings.metrics_open and not settings.metrics_require_key
    open_paths = ("/health", "/metrics") if metrics_open else ("/health",)
    app.add_middleware(
        APIKeyMiddleware, keys=KeyTable(keys), open_paths=open_paths, on_refused=refused
    )
    app.add_middleware(
        DrainMiddleware,
        admission=state.admission,
        retry_after_s=settings.retry_after_s,
        on_refused=refused,
    )
    app.add_middleware(RequestIdMiddleware)
    return app


def response_store(settings: Settings, budgets: dict[str, int]) -> ResponseStore:
    """The store `--response-store` names: this process's memory, or a shared Redis."""
    bounds = (settings.responses_store_size, settings.responses_store_max_bytes, budgets)
    if settings.response_store == "memory":
        return MemoryResponseStore(*bounds)
    return RedisResponseStore(
        settings.response_store, *bounds, retry_after_s=settings.retry_after_s
    )


def _budgets(keys: list[tuple[str, Principal]]) -> list[tuple[str, int]]:
    """Each principal's own `max_stored_bytes`, where it sets one."""
    return [(p.name, p.max_stored_bytes) for _, p in keys if p.max_stored_bytes is not None]


def rollouts(
    settings: Settings, served: Deployments, metrics: GatewayMetrics
) -> dict[str, RolloutController]:
    """The `rollout:` of the settings, driving the deployment of the same served name: the
    split randomises what `assignment` says, the candidate's slice last (users move one way)."""
    rollout = settings.rollout
    if rollout is None:
        return {}
    deployment = served.get(settings.model_name)
    names = {a.name for a in deployment.primaries}
    for name in (rollout.baseline, rollout.candidate, rollout.control):
        if name is not None and name not in names:
            raise ValueError(f"the rollout's arm `{name}` is not an arm of `{deployment.name}`")
    deployment.assignment = rollout.assignment
    deployment.arms.sort(key=lambda a: a.name == rollout.candidate)
    specs = {a.name: a for a in settings.arms or []}
    store = open_store(settings.rollout_store, deployment.name)
    compared = (rollout.candidate, rollout.reference)
    upstream = [n for n in compared if n in specs and specs[n].is_upstream]
    notes = unsampled_notes(build_spec(rollout), upstream)
    for note in notes:
        log.warning("rollout_unsampled", model=deployment.name, note=note)
    by_name = {a.name: a for a in deployment.primaries}
    controller = RolloutController(
        deployment.name,
        rollout,
        list(deployment.primaries),
        store,
        RolloutMetrics(metrics.registry),
        topology=settings.rollout_topology(),
        notes=notes,
        measurement_ready=lambda name: by_name[name].measurement_ready,
    )
    return {deployment.name: controller}


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
