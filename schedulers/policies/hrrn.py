"""`hrrn`: iteration-level scheduling, highest response ratio next.

The response ratio of a waiting sequence is (wait + predicted service) / predicted service,
with the service predicted as `sjf` does (prompt weighed in decode steps, output from
`max_tokens` or the arm's online estimate) and converted to seconds at `hrrn_step_ms` per
decode step. Short jobs go first as under `sjf`, but a long job's ratio grows with its wait,
so it overtakes newer short ones without a hard cut-off; `hrrn_max_wait_s` still bounds the
wait (overdue sequences go first, in arrival order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from schedulers.policies.sjf import SjfScheduler, check_non_negative, check_positive
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence


@dataclass(frozen=True)
class HrrnOptions:
    """hrrn's own knobs."""

    hrrn_step_ms: float = field(
        default=20.0,
        metadata={"help": "hrrn: the expected time of one decode step, in ms"},
    )
    hrrn_max_wait_s: float = field(
        default=30.0,
        metadata={"help": "hrrn: a request waiting this long goes ahead of every other"},
    )
    hrrn_prefill_weight: float = field(
        default=0.05,
        metadata={"help": "hrrn: the cost of one prompt token, in decode steps"},
    )
    hrrn_min_samples: int = field(
        default=8,
        metadata={
            "help": "hrrn: finished requests of a prompt-length bucket before their mean "
            "output length replaces max_tokens as the prediction"
        },
    )

    def __post_init__(self) -> None:
        check_positive("hrrn_step_ms", self.hrrn_step_ms)
        check_positive("hrrn_max_wait_s", self.hrrn_max_wait_s)
        check_non_negative("hrrn_prefill_weight", self.hrrn_prefill_weight)
        if self.hrrn_min_samples < 1:
            raise ValueError(f"hrrn_min_samples must be at least 1, got {self.hrrn_min_samples}")


@register_scheduler("hrrn")
class HrrnScheduler(SjfScheduler):
    """sjf's loop, ranked by the response ratio (highest first)."""

    Options: ClassVar[type[Any]] = HrrnOptions

    @property
    def max_wait_s(self) -> float:
        return float(self.options.hrrn_max_wait_s)

    @property
    def prefill_weight(self) -> float:
        return float(self.options.hrrn_prefill_weight)

    @property
    def min_samples(self) -> int:
        return int(self.options.hrrn_min_samples)

    def response_ratio(self, seq: Sequence, now: float) -> float:
        service_s = self.predicted_service(seq) * self.options.hrrn_step_ms / 1000
        return (now - seq.arrival_time + service_s) / service_s

    def rank(self, seq: Sequence, now: float) -> float:
        return -self.response_ratio(seq, now)
