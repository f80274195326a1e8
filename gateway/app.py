"""The FastAPI app factory and its lifespan (arms load in the background, stop with the app).

    app = create_app(Settings.load(), deployments=None)

Without `deployments`, one deployment is built from the settings (one local arm). While an
arm loads, /health and the OpenAI routes answer 503; a load failure is logged, keeps them at
503 and calls `state.on_fatal` (the CLI uses it to stop the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import structlog
from fastapi import FastAPI

from gateway import carousel_version
from gateway.deployment import Deployment, Deployments
from gateway.deployment_factory import deployment_from_settings
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.middleware import BodyLimitMiddleware, RequestIdMiddleware
from gateway.routes import router
from gateway.settings import Settings

log = structlog.get_logger("carousel.gateway")


@dataclass
class GatewayState:
    """What the routes reach through `request.app.state.gateway`."""

    settings: Settings
    deployments: Deployments
    metrics: GatewayMetrics
    on_fatal: Callable[[], None] | None = None
    load_failed: bool = False
    _start_task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        for deployment, arm in self.deployments.arms():
            arm.bind_metrics(self.metrics, deployment.name)
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

    async def stop(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._start_task
        for _, arm in self.deployments.arms():
            await arm.stop()


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
    app.state.gateway = GatewayState(settings, served, GatewayMetrics(served.gauges))
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    return app
