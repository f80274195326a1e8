"""What the engine streams back to callers: one delta per choice per iteration."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from schedulers.sequence import TokenLogprob


@dataclass
class RequestOutput:
    """New tokens (and text) of one choice (`index`) of one request since its last output.

    The engine fills the token fields and leaves `text` empty; the client's output
    processor (schedulers/output_processor.py) fills `text` on the consumer's side.

    The last output of a choice has `finish_reason` set: `stop`, `length`, `abort` or
    `error` (then `error` holds the message and `error_code`, when set, says why: e.g.
    `queue_timeout`). Times are `time.monotonic()` values.
    """

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: prompt tokens the prefix cache served at this choice's admission (not computed)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    created: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class IterationRecord:
    """One engine iteration, for the trace and per-iteration metrics."""

    iteration: int
    start: float  # wall-clock seconds (time.time())
    duration_s: float
    seq_ids: tuple[int, ...]
    request_ids: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    #: tokens of the sequences admitted this iteration served from the prefix cache
    num_cached_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_usage: float
    max_num_seqs: int
    #: speculative decoding (0 in a step that verified none): rows that verified drafts,
    #: their draft tokens (computed beside the decodes) and the drafts they accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens

    @property
    def verified(self) -> bool:
        """Whether this step verified draft tokens."""
        return self.num_drafts > 0
