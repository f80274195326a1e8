"""Shadow arms: a copy of a deployment's accepted requests, for an arm whose answers are
discarded and whose metrics are recorded under its own arm label.

A request is mirrored after its primary arm has accepted it (the reply or the stream is in
hand). The copy goes into the shadow arm's bounded queue with `put_nowait`, so mirroring
never waits: when the queue is full the copy is dropped and counted
(`carousel_shadow_requests_dropped_total`). A fixed pool of worker tasks per shadow arm
serves the queue, reads every reply to its end and throws it away. The client never waits
for a shadow, never sees its errors or its headers; a shadow's failure is only a status in
its own metrics and access log line. `shadow_fraction` mirrors that share of requests
(chosen by a stable hash of the request id).

A shadow that shares the device with the primary (a local arm in the same process) still
competes for it; put the shadow on another machine, as an upstream arm, to keep the primary's
latency untouched (docs/ab-testing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.api.endpoint import Endpoint
from gateway.api.errors import APIError
from gateway.api.table import BY_PATH
from gateway.arms.arm import Arm
from gateway.context import RequestContext
from gateway.obs.metrics import GatewayMetrics
from gateway.services import RequestServices
from gateway.settings.arms import DEFAULT_CONCURRENCY, DEFAULT_QUEUE_SIZE

log = structlog.get_logger("carousel.gateway")


@dataclass(frozen=True)
class ShadowCopy:
    """One mirrored request: what to send, under which id, for which served model."""

    endpoint: Endpoint
    body: dict[str, Any]
    request_id: str
    model: str


def mirrored(request_id: str, fraction: float) -> bool:
    """Whether a request is mirrored at `fraction` (stable per request id)."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class ShadowMirror:
    """The bounded queue and worker pool of one shadow arm."""

    def __init__(
        self,
        arm: Arm,
        fraction: float = 1.0,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.arm = arm
        self.fraction = fraction
        self.queue_size = queue_size
        self.concurrency = concurrency
        self.dropped = 0
        self.served = 0
        self._queue: asyncio.Queue[ShadowCopy] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._metrics: GatewayMetrics | None = None

    def start(self, metrics: GatewayMetrics | None) -> None:
        """Start the workers on the running loop."""
        self._metrics = metrics
        self._queue = asyncio.Queue(self.queue_size)
        self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []

    def offer(self, copy: ShadowCopy) -> None:
        """Queue `copy` without waiting; drop (and count) it when the queue is full."""
        if self._queue is None or not mirrored(copy.request_id, self.fraction):
            return
        try:
            self._queue.put_nowait(copy)
        except asyncio.QueueFull:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.shadow_dropped.labels(copy.model, self.arm.name).inc()

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            copy = await self._queue.get()
            try:
                await self._serve(copy)
            except Exception:  # NOTE: a shadow's failure must never reach anyone but its log
                log.exception("shadow_request_failed", arm=self.arm.name)
            finally:
                self._queue.task_done()

    async def _serve(self, copy: ShadowCopy) -> None:
        async def connected() -> bool:
            return False

        # NOTE: the storeless table's entry: a copy finds no stored conversation, keeps none
        endpoint = BY_PATH.get(copy.endpoint.path, copy.endpoint)
        request_id = f"{copy.request_id}-shadow-{self.arm.name}"
        ctx = RequestContext(
            request_id,
            endpoint.name,
            copy.model,
            connected,
            stream=bool(copy.body.get("stream")),
            raw_body=copy.body,
        )
        ctx.outcome.assign_arm(self.arm.name)
        services = RequestServices(metrics=self._metrics)
        try:
            request = endpoint.request_model.model_validate(copy.body)
            reply = await self.arm.serve(endpoint, request, ctx, services)
            if not isinstance(reply, dict):
                await _drain(reply)
        except APIError as exc:
            services.finish(ctx, exc.status_code, exc.message)
            return
        except Exception as exc:
            services.finish(ctx, 500, repr(exc))
            raise
        self.served += 1
        services.finish(ctx, 200)


async def _drain(stream: AsyncIterator[str]) -> None:
    """Read a streamed reply to its end (discarding it), closing it however it ends."""
    try:
        async for _ in stream:
            pass
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
