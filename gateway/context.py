"""What one request is: the data the route, the serving pipeline and the access log share
(the services it reports to are gateway/services.py's).

Its fields are set when the route has parsed and authenticated the request (the
constructor, or `dataclasses.replace` while the route builds it) and only read afterwards;
what happens to it while it is served is its `outcome` (gateway/outcome.py), whose methods
are the only writers of those figures.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.outcome import RequestOutcome

#: status recorded for a request whose client went away (nginx's convention)
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass
class RequestContext:
    """What one request is, and (`outcome`) what the access log line and metrics will say
    about it.

    The pipeline records the arm, token counts, TTFT and finish reasons in `outcome`;
    `RequestServices.finish` reports it (log line, metrics, traffic record), exactly once.
    The outcome's figures read through this object too (the reports read one object).
    """

    request_id: str
    endpoint: str
    model: str
    is_disconnected: Callable[[], Awaitable[bool]]
    stream: bool = False
    log_prompts: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    #: the JSON body as the client sent it (upstream arms forward it)
    raw_body: dict[str, Any] = field(default_factory=dict)
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
    #: the path the traffic record's lines name
    path: str = ""
    #: what happened to it; shared by the copies `dataclasses.replace` makes
    outcome: RequestOutcome = field(default_factory=RequestOutcome)

    def __post_init__(self) -> None:
        self.engine_request_id = self.engine_request_id or self.request_id

    @property
    def arm(self) -> str | None:
        return self.outcome.arm

    @property
    def arm_drawn(self) -> str | None:
        return self.outcome.arm_drawn

    @property
    def scheduler(self) -> str | None:
        return self.outcome.scheduler

    @property
    def prompt_tokens(self) -> int:
        return self.outcome.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.outcome.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.outcome.completion_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.outcome.ttft_s

    @property
    def itl_s(self) -> list[float]:
        return self.outcome.itl_s

    @property
    def finish_reasons(self) -> list[str]:
        return self.outcome.finish_reasons

    @property
    def prompt_text(self) -> str | None:
        return self.outcome.prompt_text
