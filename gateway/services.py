"""The gateway-wide services a request uses: the access log, the metrics, the traffic record
and the Responses API's store."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.api.responses.store import ResponseStore, remember_creator
from gateway.context import RequestContext
from gateway.obs.metrics import GatewayMetrics
from gateway.obs.traffic_record import TrafficEntry, TrafficRecorder

log = structlog.get_logger("carousel.gateway")


@dataclass(frozen=True)
class RequestServices:
    """The gateway-wide services a request's outcome goes to (None: that one is off)."""

    metrics: GatewayMetrics | None = None
    #: the traffic record (`--record-traffic`)
    recorder: TrafficRecorder | None = None
    #: where an upstream arm's Responses API ids are noted with the arm that created them
    #: (None: shadow copies); local arms' Responses endpoint has the store injected
    #: (gateway/api/table.py)
    response_store: ResponseStore | None = None
    #: told of every finished request (status, seconds since arrival): the rollouts
    on_finished: Callable[[RequestContext, int, float], None] | None = None

    async def remember_response(self, ctx: RequestContext, response_id: str) -> None:
        """Note that `ctx`'s arm (an upstream's) created `response_id` for `ctx`'s principal;
        nothing without a store."""
        if self.response_store is not None:
            await remember_creator(self.response_store, ctx, response_id)

    def finish(self, ctx: RequestContext, status: int, error: str | None = None) -> None:
        """Log `ctx` and count it in the metrics (only the first call per request counts)."""
        if not ctx.outcome.mark_finished():
            return
        total_s = time.monotonic() - ctx.start
        fields: dict[str, Any] = {
            "request_id": ctx.request_id,
            "endpoint": ctx.endpoint,
            "model": ctx.model,
            "principal": ctx.principal,
            "arm": ctx.arm,
            "scheduler": ctx.scheduler,
            "stream": ctx.stream,
            "status": status,
            "prompt_tokens": ctx.prompt_tokens,
            "cached_tokens": ctx.cached_tokens,
            "completion_tokens": ctx.completion_tokens,
            "ttft_s": None if ctx.ttft_s is None else round(ctx.ttft_s, 6),
            "total_s": round(total_s, 6),
            "finish_reason": ",".join(sorted(set(ctx.finish_reasons))) or None,
        }
        if error is not None:
            fields["error"] = error
        if ctx.log_prompts and ctx.prompt_text is not None:
            fields["prompt"] = ctx.prompt_text
        log.info("request", **fields)
        if self.metrics is not None:
            self.metrics.observe_request(ctx, status, total_s)
        if self.on_finished is not None:
            self.on_finished(ctx, status, total_s)
        if self.recorder is not None and ctx.raw_body:
            self.recorder.record(_entry(ctx, status, fields["finish_reason"], total_s))


def _entry(
    ctx: RequestContext, status: int, finish_reason: str | None, total_s: float
) -> TrafficEntry:
    return TrafficEntry(
        arrival=ctx.start,
        endpoint=ctx.path,
        body=ctx.raw_body,
        arm=ctx.arm,
        model=ctx.model,
        request_id=ctx.request_id,
        status=status,
        finish_reason=finish_reason,
        prompt_tokens=ctx.prompt_tokens,
        completion_tokens=ctx.completion_tokens,
        ttft_s=ctx.ttft_s,
        e2e_s=total_s,
    )
