"""`fair`: iteration-level scheduling with per-principal virtual token counters.

The Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI '24): each principal (`SamplingParams.principal`: the name the request's API key
resolves to, or its `user` on a gateway without keys; requests with neither share the
principal "") has a counter of the service it received, prompt tokens computed weighed by
`fair_input_weight` and output tokens by `fair_output_weight`, divided by its weight
(`fair_weights`, default 1). Each admission takes the earliest waiting sequence of the
principal with the smallest counter. A principal that comes back after having nothing
queued or running has its counter lifted to the smallest counter of the active ones (when
none is active, to the counter of the last one served), so idle time banks no credit (the
paper's counter lift).

Starvation bound: a principal's counter only grows while it is served, and an active
principal with the smallest counter is served next, so a backlogged principal waits at most
until the others' counters pass its own (the paper proves the service difference between two
backlogged clients bounded; tests/test_fair.py checks a light user never waits behind more
than one request of a heavy stream at one seat).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from schedulers.base import SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.policies.orca import OrcaScheduler
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence


def parse_weights(text: str) -> dict[str, float]:
    """`alice=2,bob=0.5` -> {"alice": 2.0, "bob": 0.5}; ValueError on a bad entry."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.rpartition("=")
        if not sep or not name:
            raise ValueError(f"fair_weights entries are PRINCIPAL=WEIGHT, got {part!r}")
        weight = float(value)
        if not weight > 0:
            raise ValueError(f"the weight of {name!r} must be positive, got {value}")
        weights[name] = weight
    return weights


@dataclass(frozen=True)
class FairOptions:
    """fair's own knobs."""

    fair_weights: str = field(
        default="",
        metadata={
            "help": "fair: per-principal weights as PRINCIPAL=WEIGHT,... (others weigh 1); "
            "a principal of weight 2 gets twice the service of one of weight 1"
        },
    )
    fair_input_weight: float = field(
        default=1.0, metadata={"help": "fair: the service counted per prompt token computed"}
    )
    fair_output_weight: float = field(
        default=2.0, metadata={"help": "fair: the service counted per output token"}
    )

    def __post_init__(self) -> None:
        parse_weights(self.fair_weights)
        for name in ("fair_input_weight", "fair_output_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")


def principal(seq: Sequence) -> str:
    """Whom a sequence is served for: its `SamplingParams.principal` ("" when it has none)."""
    return seq.sampling_params.principal or ""


@register_scheduler("fair")
class FairScheduler(OrcaScheduler):
    """Orca's loop, admitting from the principal with the least weighted service first."""

    Options = FairOptions
    options: FairOptions

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, options: Any = None
    ) -> None:
        super().__init__(config, block_manager, options)
        self.weights = parse_weights(self.options.fair_weights)
        self.counters: defaultdict[str, float] = defaultdict(float)
        self._charged: set[int] = set()  # seq_ids whose tokens of this step were charged
        self._last_served = ""  # the principal of the last sequence to finish

    def add(self, seq: Sequence) -> None:
        name = principal(seq)
        active = self._active_counters()
        if name not in active:
            floor = min(active.values()) if active else self.counters[self._last_served]
            self.counters[name] = max(self.counters[name], floor)
        super().add(seq)

    def _active_counters(self) -> dict[str, float]:
        """The counters of the principals with a sequence queued or running."""
        names = {principal(s) for s in (*self.waiting, *self.running)}
        return {name: self.counters[name] for name in names}

    def _admit_waiting(self, batch: Batch, budget: int) -> None:
        """Admit the earliest ready sequence of the least-served principal, repeatedly;
        stop at the first that does not fit (as orca does)."""
        passed: set[int] = set()
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next(passed)
            if seq is None:
                return
            num_tokens = self.admit_for_step(seq, budget, batch)
            if not num_tokens:
                return
            budget -= num_tokens
            self._charge(seq, num_tokens, 0)
            self._charged.add(seq.seq_id)

    def _next(self, passed: set[int]) -> Sequence | None:
        """The earliest ready waiting sequence of the principal with the smallest counter."""
        first: dict[str, Sequence] = {}
        for seq in self.waiting:
            if seq.seq_id in passed:
                continue
            if self.must_wait(seq):
                passed.add(seq.seq_id)
                continue
            first.setdefault(principal(seq), seq)
        if not first:
            return None
        return min(first.values(), key=lambda s: (self.counters[principal(s)], s.arrival_time))

    def _charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        weight = self.weights.get(principal(seq), 1.0)
        service = (
            self.options.fair_input_weight * prompt_tokens
            + self.options.fair_output_weight * output_tokens
        )
        self.counters[principal(seq)] += service / weight

    def update(self, batch: Batch, output: ExecuteOutput) -> list[Sequence]:
        """Charge each principal its output tokens and the prompt chunks of this step
        (admissions were charged when admitted, so the counters move within a step)."""
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            if seq.is_finished:
                continue
            if seq.seq_id not in self._charged:
                computed = seq.num_computed_tokens
                prompt = max(0, min(computed + num_tokens, seq.num_prompt_tokens) - computed)
                self._charge(seq, prompt, 0)
            if seq.seq_id in output.sampled:
                self._charge(seq, 0, 1)
        self._charged.clear()
        finished = super().update(batch, output)
        if finished:
            self._last_served = principal(finished[-1])
        return finished
