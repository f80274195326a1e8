"""What one request is: the data the route, the serving pipeline and the access log share
(the services it reports to are gateway/services.py's)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: status recorded for a request whose client went away (nginx's convention)
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass
class RequestContext:
    """What one request is, and what the access log line and metrics will say about it.

    The pipeline fills `arm`, token counts, `ttft_s` and `finish_reasons`;
    `RequestServices.finish` reports it (log line, metrics, traffic record), exactly once.
    """

    request_id: str
    endpoint: str
    model: str
    is_disconnected: Callable[[], Awaitable[bool]]
    stream: bool = False
    log_prompts: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    arm: str | None = None
    #: the arm the split drew for this request (None: pinned or continued, not drawn); it
    #: differs from `arm` when the drawn arm could not serve and another did
    arm_drawn: str | None = None
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
    #: the principal's shortest deadline, ms (its key file's `min_deadline_ms`; None: any)
    min_deadline_ms: float | None = None
    #: the priority to run at, within the principal's `min_priority` (gateway/api/scheduling.py;
    #: None: not bounded by a route, as for a shadow copy: the request's own)
    priority: int | None = None
    #: who sent it: the principal its API key resolves to (never the key itself)
    principal: str = "anonymous"
    #: the request's `user` field (the split's unit under `assignment: user`)
    user: str | None = None
    #: called once when the arm has accepted the request (shadow arms get their copy then)
    on_accepted: Callable[[], None] | None = None
    #: the path the traffic record's lines name
    path: str = ""
    #: set by the first `RequestServices.finish` (later calls report nothing)
    finished: bool = False

    def __post_init__(self) -> None:
        self.engine_request_id = self.engine_request_id or self.request_id

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
