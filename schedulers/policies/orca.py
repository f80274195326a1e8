"""`orca`: iteration-level scheduling (Yu et al., OSDI '22), decided anew every step."""

from __future__ import annotations

from schedulers.base import Scheduler
from schedulers.batch import Batch
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence, SequenceStatus


@register_scheduler("orca")
class OrcaScheduler(Scheduler):
    """FCFS; finished sequences leave after every step and waiting ones join at once.

    Each step first serves running sequences in admission order (decodes, or the rest of a
    chunked prefill), then admits waiting ones while seats, the token budget and KV blocks
    allow, so prefills and decodes share iterations. When KV runs out, the most recently
    admitted running sequence is preempted: its blocks are freed and it goes back to the head
    of the queue, to recompute prompt + output so far when it is readmitted (with prefix
    caching on, from its blocks still cached). Admission goes through `Scheduler.admit_for_step`.
    """

    def _schedule(self, batch: Batch) -> None:
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._admit_waiting(batch, budget)

    def _schedule_running(self, batch: Batch, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            target = seq.num_computed_tokens + num_tokens
            while not bm.can_allocate(seq, target):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.allocate(seq, target)
            batch.add(seq, num_tokens)
            budget -= num_tokens
            i += 1
        return budget

    def _admit_waiting(self, batch: Batch, budget: int) -> None:
        """Admit in queue order (FCFS) until one does not fit; sequences whose grammar is
        compiling, and choices waiting for their leader's prompt, are passed over."""
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self.must_wait(seq):
                continue
            num_tokens = self.admit_for_step(seq, budget, batch)
            if not num_tokens:
                return
            budget -= num_tokens

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        """Free `seq`'s KV and requeue it at the head (recompute on readmission)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
