"""`edf`: iteration-level scheduling, earliest deadline first.

A sequence's first token is due `deadline_ms` after its arrival (the request's
`X-Carousel-Deadline-Ms` header), else `edf_ttft_slo_ms` after it (the arm's TTFT SLO), and
never before its principal's `min_deadline_ms` (`SamplingParams.min_deadline_ms`).
Waiting sequences are admitted earliest deadline first. A sequence still waiting past its
deadline cannot make it: under `edf_late=last` it runs after every on-time one (late ones by
deadline; any that waited `edf_max_wait_s` goes first, so none starves), under
`edf_late=refuse` it is finished with `deadline_exceeded` (a 429 at the gateway) so the
capacity goes to requests that can still make theirs.

With `edf_tpot_slo_ms` set, running sequences are kept in order of their next token's
deadline (first token time + TPOT SLO x tokens so far): under the token budget the most
urgent decode first, and out of KV blocks the one with the most slack is preempted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from schedulers.batch import Batch
from schedulers.policies.orca import OrcaScheduler
from schedulers.policies.sjf import check_non_negative, check_positive
from schedulers.registry import register_scheduler
from schedulers.sequence import DEADLINE_EXCEEDED, FinishReason, Sequence


@dataclass(frozen=True)
class EdfOptions:
    """edf's own knobs."""

    edf_ttft_slo_ms: float = field(
        default=2000.0,
        metadata={"help": "edf: the first token's deadline when a request sets none, in ms"},
    )
    edf_tpot_slo_ms: float = field(
        default=0.0,
        metadata={"help": "edf: the time per output token running requests are held to (0: off)"},
    )
    edf_late: Literal["last", "refuse"] = field(
        default="last",
        metadata={
            "help": "edf: a request past its deadline before it started: run it after the "
            "on-time ones (last) or refuse it with a 429 (refuse)"
        },
    )
    edf_max_wait_s: float = field(
        default=30.0,
        metadata={"help": "edf: a late request waiting this long goes ahead of every other"},
    )

    def __post_init__(self) -> None:
        check_positive("edf_ttft_slo_ms", self.edf_ttft_slo_ms)
        check_positive("edf_max_wait_s", self.edf_max_wait_s)
        check_non_negative("edf_tpot_slo_ms", self.edf_tpot_slo_ms)
        if self.edf_late not in ("last", "refuse"):
            raise ValueError(f"edf_late must be 'last' or 'refuse', got {self.edf_late!r}")


@register_scheduler("edf")
class EdfScheduler(OrcaScheduler):
    """Orca's loop, admitting waiting sequences earliest first-token deadline first."""

    Options = EdfOptions
    options: EdfOptions

    def deadline(self, seq: Sequence) -> float:
        """When the first token is due (seconds on `self.clock`): as asked, else the SLO,
        never before the principal's `min_deadline_ms`."""
        params = seq.sampling_params
        deadline_ms = params.deadline_ms or self.options.edf_ttft_slo_ms
        deadline_ms = max(deadline_ms, params.min_deadline_ms or 0.0)
        return seq.arrival_time + deadline_ms / 1000

    def next_token_deadline(self, seq: Sequence) -> float:
        """When a running sequence's next token is due (inf without a TPOT SLO)."""
        if seq.first_token_time is None:
            return self.deadline(seq)
        tpot_s = self.options.edf_tpot_slo_ms / 1000
        return seq.first_token_time + tpot_s * seq.num_output_tokens if tpot_s else math.inf

    def is_late(self, seq: Sequence, now: float) -> bool:
        return seq.first_scheduled_time is None and now > self.deadline(seq)

    def _schedule(self, batch: Batch) -> None:
        now = self.clock()
        if self.options.edf_tpot_slo_ms:
            self.running.sort(key=self.next_token_deadline)
        self.waiting = type(self.waiting)(sorted(self.waiting, key=lambda s: self._key(s, now)))
        super()._schedule(batch)

    def _key(self, seq: Sequence, now: float) -> tuple[int, float]:
        """Preempted first, then those waiting `edf_max_wait_s` by arrival, then the on-time
        ones by deadline, then the late ones by deadline."""
        if seq.first_scheduled_time is not None:
            return (0, 0.0)
        if now - seq.arrival_time >= self.options.edf_max_wait_s:
            return (1, seq.arrival_time)
        return (3 if self.is_late(seq, now) else 2, self.deadline(seq))

    def expire_waiting(self, now: float) -> list[Sequence]:
        """Besides queue timeouts, under `edf_late=refuse`: finish (with `deadline_exceeded`)
        the waiting sequences that can no longer start before their deadline."""
        expired = super().expire_waiting(now)
        if self.options.edf_late != "refuse":
            return expired
        late = [seq for seq in self.waiting if self.is_late(seq, now)]
        for seq in late:
            self.waiting.remove(seq)
            waited_ms = (now - seq.arrival_time) * 1000
            due_ms = (self.deadline(seq) - seq.arrival_time) * 1000
            self.finish(
                seq,
                FinishReason.ERROR,
                f"the request could not start within its {due_ms:.0f} ms deadline "
                f"(it waited {waited_ms:.0f} ms)",
            )
            seq.error_code = DEADLINE_EXCEEDED
        return expired + late
