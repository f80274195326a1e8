"""Random interleavings of add/schedule/finish/abort/preempt through the real policies.

Unlike test_prefix_cache_machine.py (the block manager alone), here orca, static and lpm make
every admission decision, with chunked prefill on or off, `n > 1` requests and a KV cache of
a few blocks, in one group or with sliding-window groups beside it (a static batch's
reservation must then cover window blocks another member drops while this one holds them).
A fake backend "computes" each scheduled token by recording which token prefix its KV slot
was computed from, and samples a token that depends only on that prefix (so equal
histories continue equally and outputs get shared too). After every step: the accounting
holds, every slot a sequence attends to holds KV of its own prefix (a hit never serves wrong
KV), and no two sequences of a batch write the same block, nor anyone a shared one.
"""

from __future__ import annotations

import itertools
from unittest import mock

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from schedulers.base import AdmissionError, Scheduler, SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import FinishReason, Sequence, TokenLogprob

NUM_BLOCKS, BS = 8, 2
BASES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 0, 0, 5], [3, 3, 3, 3, 3, 3]]
PICK = st.integers(0, 1000)
MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None)


def next_token(prefix: tuple[int, ...]) -> int:
    """What the fake model samples after `prefix`: a function of the prefix alone."""
    return sum(prefix) % 3


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> its prefix
        self.seq_ids = itertools.count()
        self.seqs: list[Sequence] = []
        self.sched: Scheduler

    @initialize(
        policy=st.sampled_from(["orca", "static", "lpm"]),
        chunked=st.booleans(),
        budget=st.integers(2, 8),
        max_num_seqs=st.integers(1, 4),
        max_skips=st.integers(0, 3),
        windows=st.sampled_from([(), (), (3,), (5, 2)]),
    )
    def start(
        self,
        policy: str,
        chunked: bool,
        budget: int,
        max_num_seqs: int,
        max_skips: int,
        windows: tuple[int, ...],
    ) -> None:
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=True,
            max_model_len=NUM_BLOCKS * BS,
        )
        bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, windows=windows)
        if windows:
            event(f"{policy}: window groups {windows}")
        self.sched = create_scheduler(policy, config, bm, {"max_skips": max_skips})

    # -- rules -------------------------------------------------------------------------------

    @rule(
        base=st.sampled_from(BASES),
        extra=st.lists(st.integers(0, 2), max_size=3),
        max_tokens=st.integers(1, 4),
        n=st.integers(1, 3),
    )
    def add(self, base: list[int], extra: list[int], max_tokens: int, n: int) -> None:
        tokens = base + extra or [0]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request_id = f"r{next(self.seq_ids)}"
        choices: list[Sequence] = []
        for index in range(n):
            leader = choices[0] if choices else None
            seq = Sequence(
                next(self.seq_ids), request_id, list(tokens), params, index, leader=leader
            )
            choices.append(seq)
        try:
            for seq in choices:
                self.sched.add(seq)
        except AdmissionError:
            return  # too long for this cache: refused before anything was queued
        self.seqs += choices

    @precondition(lambda self: self.sched.has_work)
    @rule()
    def step(self) -> None:
        batch = self.sched.schedule()
        self._check_writes(batch)
        if batch.num_cached_tokens:
            event(f"{self.sched.name}: a step served tokens from the cache")
        if batch.preempted:
            event(f"{self.sched.name}: a step preempted")
        if any(s.leader is not None and s.num_cached_tokens for s in batch.seqs):
            event(f"{self.sched.name}: a later choice started from the cache")
        sampled: dict[int, TokenLogprob] = {}
        for i, (seq, num_tokens) in enumerate(
            zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
        ):
            tokens = seq.all_token_ids()
            start = seq.num_computed_tokens
            for pos in range(start, start + num_tokens):
                self.kv[(seq.block_table[pos // BS], pos % BS)] = tuple(tokens[: pos + 1])
            for pos in range(start + num_tokens):  # what attention reads
                slot = (seq.block_table[pos // BS], pos % BS)
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (seq.seq_id, pos)
            if batch.samples_after(i):
                sampled[seq.seq_id] = TokenLogprob(next_token(tuple(tokens)), 0.0)
        self.sched.update(batch, ExecuteOutput(sampled))

    def _check_writes(self, batch: Batch) -> None:
        bm = self.sched.block_manager
        writer: dict[int, int] = {}
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            assert num_tokens > 0
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + num_tokens
            first, last = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens - 1
            for block in seq.block_table[first // BS : last // BS + 1]:
                assert writer.setdefault(block, seq.seq_id) == seq.seq_id, block
                assert bm._ref_counts[block] == 1 and block not in bm._cached, block

    @precondition(lambda self: self.sched.running)
    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        """A stop string matched on the client's side."""
        seq = self.sched.running[pick % len(self.sched.running)]
        self.sched.finish_running(seq, FinishReason.STOP)

    @precondition(lambda self: self.sched.has_work)
    @rule(pick=PICK)
    def abort(self, pick: int) -> None:
        queued = [*self.sched.running, *self.sched.waiting]
        self.sched.abort(queued[pick % len(queued)].seq_id)

    @precondition(lambda self: self.sched.name != "static" and self.sched.running)
    @rule(pick=PICK)
    def preempt(self, pick: int) -> None:
        seq = self.sched.running[pick % len(self.sched.running)]
        self.sched._preempt(seq, Batch(0))  # type: ignore[attr-defined]

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def accounting_holds(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        sched.block_manager.check_invariants(sched.running)
        assert all(not s.block_table and not s.num_computed_tokens for s in sched.waiting)
        assert len(sched.running) <= sched.config.max_num_seqs
        queued = {s.seq_id for s in (*sched.running, *sched.waiting)}
        assert all(s.seq_id in queued or s.is_finished for s in self.seqs)
        if not sched.has_work:
            assert sched.block_manager.num_free_blocks == NUM_BLOCKS

    @invariant()
    def outputs_follow_the_model(self) -> None:
        for seq in self.seqs:
            tokens = seq.all_token_ids()
            for i in range(seq.num_prompt_tokens, len(tokens)):
                assert tokens[i] == next_token(tuple(tokens[:i])), (seq.seq_id, i)


def test_policies_under_random_interleavings() -> None:
    run_state_machine_as_test(PolicyMachine, settings=MACHINE_SETTINGS)


def test_policies_under_random_interleavings_with_colliding_hashes() -> None:
    def weak_hash(parent: int, token_ids: tuple[int, ...]) -> int:
        return sum(token_ids) % 3  # most blocks collide; the parent is ignored

    with mock.patch("schedulers.block_manager.hash_block_tokens", weak_hash):
        run_state_machine_as_test(PolicyMachine, settings=MACHINE_SETTINGS)
