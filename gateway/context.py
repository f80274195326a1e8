"""Per-request state shared by the route, the serving pipeline and the access log."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.metrics import GatewayMetrics
from gateway.response_store import ResponseStore
from gateway.traffic_record import TrafficEntry, TrafficRecorder

log = structlog.get_logger("carousel.gateway")

#: status recorded for a request whose client went away (nginx's convention)
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass
class RequestContext:
    """What one request is, and what the access log line and metrics will say about it.

    The pipeline fills `arm`, token counts, `ttft_s` and `finish_reasons`; `finish()` writes
    the single access log line and updates the metrics, exactly once.
    """

    request_id: str
    endpoint: str
    model: str
    is_disconnected: Callable[[], Awaitable[bool]]
    metrics: GatewayMetrics | None = None
    stream: bool = False
    log_prompts: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    arm: str | None = None
    scheduler: str | None = None
    prompt_tokens: int = 0
    #: of the prompt tokens, those the prefix cache served (first choice of each prompt)
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    prompt_text: str | None = None
    #: the JSON body as the client sent it (upstream arms forward it)
    raw_body: dict[str, Any] = field(default_factory=dict)
    #: gaps between successive token deliveries of this request (inter-token latency)
    itl_s: list[float] = field(default_factory=list)
    _last_token_at: float | None = None
    #: the engine's id; differs from `request_id` (by a suffix) when the client chose that
    engine_request_id: str = ""
    #: the first token's deadline, ms after arrival (`X-Carousel-Deadline-Ms`; `edf` reads it)
    deadline_ms: float | None = None
    #: called once when the arm has accepted the request (shadow arms get their copy then)
    on_accepted: Callable[[], None] | None = None
    #: the traffic record, and the path its lines name (None: not recorded)
    recorder: TrafficRecorder | None = None
    path: str = ""
    #: where the Responses API keeps `store: true` responses (None: nothing is stored, and
    #: no `previous_response_id` is found: shadow copies)
    response_store: ResponseStore | None = None
    _done: bool = False

    def __post_init__(self) -> None:
        self.engine_request_id = self.engine_request_id or self.request_id

    def remember_response(self, response_id: str) -> None:
        """Note that this request's arm created `response_id` (GET, DELETE and
        `previous_response_id` are routed to it); nothing without a store."""
        if self.response_store is not None and self.arm is not None:
            self.response_store.remember_owner(response_id, self.model, self.arm)

    def accept(self) -> None:
        """The arm took the request (it is queued, or its upstream answered): run
        `on_accepted`, once."""
        callback, self.on_accepted = self.on_accepted, None
        if callback is not None:
            callback()

    def mark_token(self) -> None:
        """Record a token delivery: the first sets TTFT, later ones add an ITL gap."""
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - self.start
        elif self._last_token_at is not None:
            self.itl_s.append(now - self._last_token_at)
        self._last_token_at = now

    def finish(self, status: int, error: str | None = None) -> None:
        """Log the request and count it in the metrics (only the first call counts)."""
        if self._done:
            return
        self._done = True
        total_s = time.monotonic() - self.start
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "arm": self.arm,
            "scheduler": self.scheduler,
            "stream": self.stream,
            "status": status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "total_s": round(total_s, 6),
            "finish_reason": ",".join(sorted(set(self.finish_reasons))) or None,
        }
        if error is not None:
            fields["error"] = error
        if self.log_prompts and self.prompt_text is not None:
            fields["prompt"] = self.prompt_text
        log.info("request", **fields)
        if self.metrics is not None:
            self.metrics.observe_request(self, status, total_s)
        if self.recorder is not None and self.raw_body:
            self.recorder.record(self._entry(status, fields["finish_reason"], total_s))

    def _entry(self, status: int, finish_reason: str | None, total_s: float) -> TrafficEntry:
        return TrafficEntry(
            arrival=self.start,
            endpoint=self.path,
            body=self.raw_body,
            arm=self.arm,
            model=self.model,
            request_id=self.request_id,
            status=status,
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            ttft_s=self.ttft_s,
            e2e_s=total_s,
        )
