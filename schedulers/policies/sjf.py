"""`sjf`: iteration-level scheduling, shortest predicted job first.

A waiting sequence's job is its predicted service in output-token steps: its prompt weighed
by `sjf_prefill_weight` (a prompt token costs a fraction of a decode step) plus its predicted
output length. The output prediction is the request's `max_tokens`, lowered, once the arm has
seen `sjf_min_samples` finished sequences of the same prompt-length bucket (powers of two),
to their running mean output length: a small online estimate, no model.

Aging: a sequence waiting `sjf_max_wait_s` becomes overdue and goes ahead of every
non-overdue one (overdue ones in arrival order), so nothing waits more than that bound plus
the time to drain the overdue ones ahead of it. Preempted sequences go first, as in orca.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from schedulers.base import SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.policies.orca import OrcaScheduler
from schedulers.registry import register_scheduler
from schedulers.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class SjfOptions:
    """sjf's own knobs."""

    sjf_max_wait_s: float = field(
        default=10.0,
        metadata={"help": "sjf: a request waiting this long goes ahead of every shorter job"},
    )
    sjf_prefill_weight: float = field(
        default=0.05,
        metadata={"help": "sjf: the cost of one prompt token, in decode steps"},
    )
    sjf_min_samples: int = field(
        default=8,
        metadata={
            "help": "sjf: finished requests of a prompt-length bucket before their mean "
            "output length replaces max_tokens as the prediction"
        },
    )

    def __post_init__(self) -> None:
        check_positive("sjf_max_wait_s", self.sjf_max_wait_s)
        check_non_negative("sjf_prefill_weight", self.sjf_prefill_weight)
        if self.sjf_min_samples < 1:
            raise ValueError(f"sjf_min_samples must be at least 1, got {self.sjf_min_samples}")


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be at least 0, got {value}")


class OutputLengthEstimate:
    """Mean output length of finished sequences per prompt-length bucket (powers of two)."""

    def __init__(self, min_samples: int) -> None:
        self.min_samples = min_samples
        self._count: defaultdict[int, int] = defaultdict(int)
        self._total: defaultdict[int, int] = defaultdict(int)

    @staticmethod
    def bucket(num_prompt_tokens: int) -> int:
        return num_prompt_tokens.bit_length()

    def observe(self, seq: Sequence) -> None:
        key = self.bucket(seq.num_prompt_tokens)
        self._count[key] += 1
        self._total[key] += seq.num_output_tokens

    def predict(self, seq: Sequence) -> float:
        """Output tokens still to come: max_tokens, or the bucket's mean once it has enough
        samples (never above max_tokens)."""
        limit = seq.sampling_params.max_tokens
        key = self.bucket(seq.num_prompt_tokens)
        if self._count[key] >= self.min_samples:
            limit = min(limit, max(1, round(self._total[key] / self._count[key])))
        return max(1, limit - seq.num_output_tokens)


@register_scheduler("sjf")
class SjfScheduler(OrcaScheduler):
    """Orca's loop, admitting waiting sequences shortest predicted job first."""

    Options: ClassVar[type[Any]] = SjfOptions
    options: Any

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, options: Any = None
    ) -> None:
        super().__init__(config, block_manager, options)
        self.estimate = OutputLengthEstimate(self.min_samples)

    # the knobs, read through properties so `hrrn` (which shares this loop) names its own
    @property
    def max_wait_s(self) -> float:
        return float(self.options.sjf_max_wait_s)

    @property
    def prefill_weight(self) -> float:
        return float(self.options.sjf_prefill_weight)

    @property
    def min_samples(self) -> int:
        return int(self.options.sjf_min_samples)

    def predicted_service(self, seq: Sequence) -> float:
        """Predicted remaining work in decode steps: weighted prompt plus output to come."""
        prompt = self.prefill_weight * max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        return prompt + self.estimate.predict(seq)

    def rank(self, seq: Sequence, now: float) -> float:
        """Lower runs first: the predicted job."""
        return self.predicted_service(seq)

    def _schedule(self, batch: Batch) -> None:
        now = self.clock()
        self.waiting = type(self.waiting)(sorted(self.waiting, key=lambda s: self._key(s, now)))
        super()._schedule(batch)

    def _key(self, seq: Sequence, now: float) -> tuple[int, float]:
        """Preempted first (they already ran), then overdue by arrival, then by rank."""
        if seq.first_scheduled_time is not None:
            return (0, 0.0)
        if now - seq.arrival_time >= self.max_wait_s:
            return (1, seq.arrival_time)
        return (2, self.rank(seq, now))

    def update(self, batch: Batch, output: ExecuteOutput) -> list[Sequence]:
        finished = super().update(batch, output)
        for seq in finished:
            if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.estimate.observe(seq)
        return finished
