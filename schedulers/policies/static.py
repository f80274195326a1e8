"""`static`: request-level batching, the Orca paper's baseline (FasterTransformer style)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from schedulers.base import Scheduler
from schedulers.batch import Batch
from schedulers.block_manager import blocks_for
from schedulers.registry import register_scheduler
from schedulers.sequence import SequenceStatus


@dataclass(frozen=True)
class StaticOptions:
    """static's own knobs."""

    batch_wait_ms: float = field(
        default=0.0, metadata={"help": "static: wait this long (ms) for a batch to fill"}
    )

    def __post_init__(self) -> None:
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be at least 0, got {self.batch_wait_ms}")


@register_scheduler("static")
class StaticScheduler(Scheduler):
    """Form a batch when nothing runs; run it until every member has finished.

    A batch takes up to `max_num_seqs` waiting requests in arrival order, waiting up to
    `batch_wait_ms` after the oldest arrived for it to fill. Formation reserves each
    member's worst case (prompt + max_tokens) in KV blocks, as the baseline systems do, so a
    running batch never runs out. The members' prompts are prefilled together, spread over
    as many iterations as the token budget needs. Nobody joins meanwhile; a member that
    finishes early returns at once and its seat stays empty until the whole batch is done.
    """

    Options = StaticOptions
    options: StaticOptions

    def _schedule(self, batch: Batch) -> None:
        if not self.running:
            if not self._ready_to_form():
                return
            self._form_batch()
        budget = self.config.max_num_batched_tokens
        for seq in self.running:
            if budget <= 0:
                break
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_tokens)
            batch.add(seq, num_tokens)
            budget -= num_tokens

    def _ready_to_form(self) -> bool:
        if not self.waiting:
            return False
        if len(self.waiting) >= self.config.max_num_seqs:
            return True
        return time.monotonic() >= self._form_deadline()

    def _form_deadline(self) -> float:
        """When the oldest waiting request stops waiting for the batch to fill."""
        return self.waiting[0].arrival_time + self.options.batch_wait_ms / 1000.0

    def _form_batch(self) -> None:
        bm = self.block_manager
        free_blocks = bm.num_free_blocks
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            reserve = blocks_for(seq.max_total_tokens, bm.block_size)
            if self.running and reserve > free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            free_blocks -= reserve

    def next_wakeup(self) -> float | None:
        if self.running or not self.waiting:
            return None
        return self._form_deadline()
