"""What happened to one request: the arm that took it, its tokens, its timings and how it
ended. The request itself (gateway/context.py) is fixed once the route has parsed it; this
record grows while it is served, and only its methods write it, so a reader can find every
writer of a figure by the method's name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RequestOutcome:
    """What the access log line, the metrics, the traffic record and the rollouts will say
    about one request. Its fields are read freely and written only by the methods below."""

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
    #: gaps between successive token deliveries of this request (inter-token latency)
    itl_s: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    #: the prompt as the endpoint rendered it (logged only under `log_prompts`)
    prompt_text: str | None = None
    #: set by the first `RequestServices.finish` (later calls report nothing)
    finished: bool = False
    _last_token_at: float | None = None
    #: called once when the arm has accepted the request (shadow arms get their copy then)
    _on_accepted: Callable[[], None] | None = None

    def record_draw(self, arm: str | None) -> None:
        """The split drew `arm` (None: no arm has weight); served by it or not."""
        self.arm_drawn = arm

    def assign_arm(self, arm: str) -> None:
        """`arm` serves the request."""
        self.arm = arm

    def assign_scheduler(self, scheduler: str) -> None:
        """The arm runs the request under `scheduler` (`upstream:<model>` for an upstream)."""
        self.scheduler = scheduler

    def record_prompt(self, text: str | None) -> None:
        """The prompt as the endpoint rendered it, for the log."""
        self.prompt_text = text

    def record_prompt_tokens(self, count: int) -> None:
        """The prompts' length in tokens, each prompt counted once."""
        self.prompt_tokens = count

    def record_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The token counts an upstream reported (each report replaces the last)."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def record_token(self, arrived_at: float) -> None:
        """A token delivery: the first sets TTFT (from `arrived_at`, the request's
        `time.monotonic()` arrival), later ones add an ITL gap."""
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - arrived_at
        elif self._last_token_at is not None:
            self.itl_s.append(now - self._last_token_at)
        self._last_token_at = now

    def add_completion_tokens(self, count: int) -> None:
        """`count` more generated tokens (added as they come, so aborted requests count)."""
        self.completion_tokens += count

    def record_finish(self, reason: str, cached_tokens: int = 0) -> None:
        """A choice ended for `reason`; `cached_tokens` of its prompt came from the prefix
        cache (0 for all but the first choice of a prompt, which counts it once)."""
        self.finish_reasons.append(reason)
        self.cached_tokens += cached_tokens

    def call_when_accepted(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the arm accepts the request (`accept`)."""
        self._on_accepted = callback

    def accept(self) -> None:
        """The arm took the request (it is queued, or its upstream answered): run the
        `call_when_accepted` callback, once."""
        callback, self._on_accepted = self._on_accepted, None
        if callback is not None:
            callback()

    def mark_finished(self) -> bool:
        """Whether this is the request's first report (only that one is logged and counted)."""
        first, self.finished = not self.finished, True
        return first
