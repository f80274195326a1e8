"""What every arm is: one way of serving a deployment's requests, whatever the endpoint."""

from __future__ import annotations

import abc
from typing import Any

from pydantic import BaseModel

from gateway.api.endpoint import Endpoint, Reply
from gateway.context import RequestContext
from gateway.obs.metrics import ArmGauges, ArmInfo, GatewayMetrics
from gateway.services import RequestServices
from schedulers.load_phase import KERNELS_BUILDING


class Arm(abc.ABC):
    """One way of serving a deployment's requests (a local engine, an upstream server)."""

    name: str
    kind: str
    #: share of the deployment's traffic (relative to the other arms' weights)
    weight: float = 1.0
    #: a shadow arm gets no traffic of its own, only copies of accepted requests
    shadow: bool = False
    #: the share of requests a shadow arm is sent a copy of
    shadow_fraction: float = 1.0
    #: any client may pin it (`X-Carousel-Arm`) even at zero weight (gateway/arms/choice.py)
    pinnable: bool = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Load and start; may take long (the app answers 503 meanwhile)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop serving; requests in flight end with an error."""

    @property
    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when the arm can take requests, else why not ("loading", a crash)."""

    @property
    @abc.abstractmethod
    def is_loading(self) -> bool:
        """Whether `start` is still running."""

    @property
    def max_model_len(self) -> int | None:
        return None

    @abc.abstractmethod
    async def serve(
        self, endpoint: Endpoint, request: BaseModel, ctx: RequestContext, services: RequestServices
    ) -> Reply:
        """Serve one request of `endpoint` (`request` is its validated request model)."""

    async def lookup(
        self, method: str, path: str, params: dict[str, str], model: str
    ) -> dict[str, Any] | None:
        """A GET or DELETE of an object the arm's server stores (`path` under /v1, e.g.
        /responses/{id}), answered with `model` as the served name; an APIError (a 404 when
        it is not there). None: the arm keeps no objects of its own (a local arm, whose
        responses are in the gateway's store)."""
        return None

    def bind_metrics(self, metrics: GatewayMetrics, model: str) -> None:  # noqa: B027
        """Called once before `start`: where the arm reports engine-level series."""

    def trace(self) -> dict[str, Any] | None:
        """The arm's iteration trace (`/debug/trace`); None for arms without an engine."""
        return None

    def gauges(self, model: str) -> ArmGauges | None:
        """Engine occupancy for /metrics (None for arms without a local engine)."""
        return None

    @property
    def serving_kernels(self) -> str | None:
        """Which ops serve a local engine's CPU forward (schedulers/load_phase.py's
        `KERNELS_*`); None where that does not apply (an upstream, the sim, CUDA)."""
        return None

    @property
    def measurement_ready(self) -> bool:
        """Whether a measurement of this arm may count now: not while its CPU kernels build
        in the background, since it would then span two paths (torch's ops, then the
        kernels'). A rollout holds its decision meanwhile."""
        return self.serving_kernels != KERNELS_BUILDING

    @abc.abstractmethod
    def info(self, model: str) -> ArmInfo:
        """What the arm is and which device group it computes on (`carousel_arm_info`)."""
