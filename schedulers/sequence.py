"""Per-sequence state: what the scheduler, the block manager and the backend share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schedulers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from schedulers.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or asked to cancel
    ERROR = "error"  # rejected at admission, failed inside a step, or waited too long


#: `error_code` of a sequence that was never scheduled within `max_queue_wait_s`
QUEUE_TIMEOUT = "queue_timeout"
#: `error_code` of a sequence refused because it can no longer start before its deadline (`edf`)
DEADLINE_EXCEEDED = "deadline_exceeded"


@dataclass
class TokenLogprob:
    """The sampled token's logprob and, when asked, the top alternatives (id, logprob)."""

    token_id: int
    logprob: float  # NaN when the sequence's params did not ask for logprobs
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One generated choice of one request.

    NOTE: `num_computed_tokens` counts tokens whose KV is in the cache; it catches up with
    `num_tokens` one scheduled chunk at a time. A decoding sequence has exactly one token
    (the last sampled one) not yet computed.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    #: lower runs first, for the policies that read it (`priority`); others ignore it
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None
    block_table: list[int] = field(default_factory=list)
    #: one block table per window group of the KV cache (block_manager.py; empty: one group)
    window_tables: list[list[int]] = field(default_factory=list)
    #: chained hashes of the full token blocks (prompt + output), filled lazily by the block
    #: manager when prefix caching is on; tokens are only ever appended, so they stay valid
    block_hashes: list[int] = field(default_factory=list)
    #: prompt tokens served from the prefix cache when this sequence was first admitted
    num_cached_tokens: int = 0
    #: choice 0 of the same request when this is a later choice of an `n > 1` request: with
    #: prefix caching on, this choice starts only once its leader has cached the prompt
    leader: Sequence | None = field(default=None, repr=False)
    #: the matcher of this sequence's output grammar (None: unconstrained); it always stands
    #: at the end of `output_token_ids` (the scheduler advances it with each sampled token)
    grammar: SequenceGrammar | None = field(default=None, repr=False)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens this sequence may ever generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
