"""`priority`: iteration-level scheduling by the request's `priority` (lower runs first).

As vLLM accepts it: a request's `priority` is an integer, lower values run earlier; among
equal priorities, first come first served. It is orca's loop with two changes:

- Running and waiting sequences are kept in priority order (then arrival order), so under
  the token budget the most urgent run first, and when KV blocks run out the least urgent
  running sequence is the one preempted (recomputed later, from its cached blocks when
  prefix caching is on).
- A waiting sequence more urgent than the least urgent running one takes its place when
  the seats (`max_num_seqs`) or the KV blocks are all taken: the running one is preempted.
  Equal priorities never preempt each other.

`aging_s` (0: off) makes waiting count: every `aging_s` seconds a sequence has waited lowers
its effective priority by one, so a bounded stream of urgent requests cannot keep a less
urgent one waiting forever. Without aging, a sequence of the lowest priority runs only when
no more urgent one waits: under a sustained urgent stream it can wait indefinitely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schedulers.batch import Batch
from schedulers.policies.orca import OrcaScheduler
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence


@dataclass(frozen=True)
class PriorityOptions:
    """priority's own knobs."""

    aging_s: float = field(
        default=0.0,
        metadata={
            "help": "priority: each this many seconds of waiting makes a request one level "
            "more urgent (0: no aging)"
        },
    )

    def __post_init__(self) -> None:
        if self.aging_s < 0:
            raise ValueError(f"aging_s must be at least 0, got {self.aging_s}")


@register_scheduler("priority")
class PriorityScheduler(OrcaScheduler):
    """Orca's loop in priority order, preempting less urgent sequences for more urgent ones."""

    Options = PriorityOptions
    options: PriorityOptions

    def _schedule(self, batch: Batch) -> None:
        now = self.clock()
        self.running.sort(key=lambda s: self._key(s, now))
        self.waiting = type(self.waiting)(sorted(self.waiting, key=lambda s: self._key(s, now)))
        self._make_room(batch, now)
        super()._schedule(batch)

    def _key(self, seq: Sequence, now: float) -> tuple[float, float]:
        return (self._urgency(seq, now), seq.arrival_time)

    def _urgency(self, seq: Sequence, now: float) -> float:
        """The effective priority: its own, lowered by one per `aging_s` waited."""
        if self.options.aging_s <= 0 or seq.first_scheduled_time is not None:
            return float(seq.priority)
        return seq.priority - (now - seq.arrival_time) // self.options.aging_s

    def _make_room(self, batch: Batch, now: float) -> None:
        """While the most urgent waiting sequence lacks a seat or KV blocks, preempt the least
        urgent running one, if it is less urgent (orca admits the waiting one next step)."""
        candidate = next((s for s in self.waiting if not self.must_wait(s)), None)
        if candidate is None:
            return
        while self.running:
            seats = len(self.running) < self.config.max_num_seqs
            hit = self.prefix_hit(candidate)
            if seats and self.block_manager.can_allocate(candidate, candidate.num_tokens, hit):
                return
            victim = self.running[-1]
            if self._urgency(victim, now) <= self._urgency(candidate, now):
                return
            self._preempt(victim, batch)
