"""`lpm`: longest prefix match first (SGLang's default policy with its radix cache)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from schedulers.base import SchedulerConfig
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.policies.orca import OrcaScheduler
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence

#: waiting sequences ranked per step; those further back wait in arrival order (SGLang falls
#: back to FCFS above 128 waiting for the same reason: a lookup per waiting request per step)
LOOKAHEAD = 128


@dataclass(frozen=True)
class LpmOptions:
    """lpm's own knobs."""

    max_skips: int = field(
        default=8,
        metadata={
            "help": "lpm: most times a waiting request may be passed over by later ones with "
            "longer cached prefixes; then it goes first"
        },
    )

    def __post_init__(self) -> None:
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be at least 0, got {self.max_skips}")


@register_scheduler("lpm")
class LpmScheduler(OrcaScheduler):
    """Orca's iteration-level loop, admitting the waiting sequences with the longest cached
    prefix first, so requests that share a prefix run while it is cached.

    Running sequences are served as in orca (preemption included). Waiting ones are admitted
    in order of cached-prefix length, longest first, arrival order breaking ties; admission
    stops at the first that does not fit, as in orca. A sequence passed over (a later
    arrival admitted before it) `max_skips` times goes ahead of every other: no starvation.
    `max_skips=0` is orca's FCFS.
    """

    Options = LpmOptions
    options: LpmOptions

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, options: Any = None
    ) -> None:
        super().__init__(config, block_manager, options)
        self._skips: dict[int, int] = {}  # seq_id -> times passed over while waiting

    def _admit_waiting(self, batch: Batch, budget: int) -> None:
        position = {seq.seq_id: i for i, seq in enumerate(self.waiting)}
        last_admitted = -1
        for seq in self._admission_order(position):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            num_tokens = self.admit_for_step(seq, budget, batch)
            if not num_tokens:
                break
            last_admitted = max(last_admitted, position[seq.seq_id])
            budget -= num_tokens
        self._count_skips(position, last_admitted)

    def _admission_order(self, position: dict[int, int]) -> list[Sequence]:
        """Starving sequences first (queue order), then by cached prefix, longest first."""
        head = list(itertools.islice(self.waiting, LOOKAHEAD))
        rest = list(itertools.islice(self.waiting, LOOKAHEAD, None))
        rest = [seq for seq in rest if not self.waits_for_grammar(seq)]
        ready = [seq for seq in head if not self.must_wait(seq)]
        limit = self.options.max_skips
        starving = [s for s in ready if self._skips.get(s.seq_id, 0) >= limit]
        others = [s for s in ready if self._skips.get(s.seq_id, 0) < limit]
        others.sort(key=lambda s: (-self.prefix_hit(s).num_tokens, position[s.seq_id]))
        return [*starving, *others, *rest]

    def _count_skips(self, position: dict[int, int], last_admitted: int) -> None:
        """Count a pass-over for every sequence still waiting that was ahead (in queue order)
        of one admitted this step; forget the sequences that left the queue."""
        skips: dict[int, int] = {}
        for seq in self.waiting:
            count = self._skips.get(seq.seq_id, 0)
            if position.get(seq.seq_id, last_admitted) < last_admitted:
                count += not self.must_wait(seq)
            if count:
                skips[seq.seq_id] = count
        self._skips = skips
