"""Random interleavings of admit/schedule/compute/finish/abort/preempt over a small cache.

The machine plays scheduler and backend: it admits through the prefix cache, allocates
chunks, "computes" them by recording in a model of the KV cache which token prefix each
slot's KV was computed from, and samples tokens. After every step the block accounting must
hold, every computed slot of every sequence must hold KV of that sequence's own prefix (so
a hit never serves wrong KV) and no two sequences may write the same block. The window
variant adds a sliding-window group (block_manager.py's KV cache groups): each window table
must hold its own prefix's KV over the next token's window, whatever it dropped before it.
"""

from __future__ import annotations

import itertools
from unittest import mock

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from schedulers.block_manager import NO_BLOCK, BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

NUM_BLOCKS, BS = 6, 2
#: prompts start from a few shared "system prompts" so that hits happen
BASES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 0, 0, 5], [3, 3, 3, 3, 3, 3]]
PICK = st.integers(0, 1000)
MACHINE_SETTINGS = settings(max_examples=200, stateful_step_count=80, deadline=None)


class PrefixCacheMachine(RuleBasedStateMachine):
    #: the window groups' sliding windows, and the pool they share with the full group
    WINDOWS: tuple[int, ...] = ()
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            self.NUM_BLOCKS, BS, enable_prefix_caching=True, windows=self.WINDOWS
        )
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # every sequence holding blocks
        self.scheduled: dict[int, int] = {}  # seq_id -> tokens allocated for the next step
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> its prefix
        self.seq_ids = itertools.count()

    # -- rules -------------------------------------------------------------------------------

    @rule(
        base=st.sampled_from(BASES),
        extra=st.lists(st.integers(0, 2), max_size=2),
        max_tokens=st.integers(1, 2),
    )
    def add(self, base: list[int], extra: list[int], max_tokens: int) -> None:
        seq_id = next(self.seq_ids)
        tokens = base + extra or [0]
        params = SamplingParams(max_tokens=max_tokens)
        self.waiting.append(Sequence(seq_id, f"r{seq_id}", tokens, params))

    @precondition(lambda self: self.waiting)
    @rule(pick=PICK, chunk=st.integers(1, 6))
    def admit(self, pick: int, chunk: int) -> None:
        seq = self.waiting[pick % len(self.waiting)]
        hit = self.bm.computed_prefix(seq)
        assert hit.num_tokens < seq.num_tokens
        num_tokens = min(seq.num_tokens - hit.num_tokens, chunk)
        target = hit.num_tokens + num_tokens
        if not self.bm.can_allocate(seq, target, hit):
            return
        self.bm.allocate(seq, target, hit)
        assert seq.num_computed_tokens == hit.num_tokens
        self.waiting.remove(seq)
        self.running.append(seq)
        self.scheduled[seq.seq_id] = num_tokens

    @precondition(lambda self: any(s.seq_id not in self.scheduled for s in self.running))
    @rule(pick=PICK, chunk=st.integers(1, 6))
    def schedule(self, pick: int, chunk: int) -> None:
        idle = [s for s in self.running if s.seq_id not in self.scheduled]
        seq = idle[pick % len(idle)]
        num_tokens = min(seq.num_tokens - seq.num_computed_tokens, chunk)
        target = seq.num_computed_tokens + num_tokens
        if self.bm.can_allocate(seq, target):
            self.bm.allocate(seq, target)
            self.scheduled[seq.seq_id] = num_tokens
        else:
            self._preempt(seq)

    @precondition(lambda self: self.scheduled)
    @rule(pick=PICK, sampled=st.integers(0, 2), rejected=st.integers(0, 2))
    def compute(self, pick: int, sampled: int, rejected: int) -> None:
        """Compute the scheduled tokens; the last `rejected` of them as rejected drafts are:
        their slots written with other KV and not counted computed (speculative decoding's
        verify step allocates past what it keeps)."""
        seq = [s for s in self.running if s.seq_id in self.scheduled][pick % len(self.scheduled)]
        num_tokens = self.scheduled.pop(seq.seq_id)
        rejected = min(rejected, num_tokens - 1)
        tokens = seq.all_token_ids()
        start = seq.num_computed_tokens
        for pos in range(start, start + num_tokens):
            kept = pos < start + num_tokens - rejected
            for table in (seq.block_table, *seq.window_tables):
                assert table[pos // BS] != NO_BLOCK, (seq.seq_id, pos)
                self.kv[(table[pos // BS], pos % BS)] = tuple(tokens[: pos + 1]) if kept else ()
        seq.num_computed_tokens += num_tokens - rejected
        self.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return  # a chunk of a prefill: nothing to sample yet
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            self._drop(seq)
        else:
            seq.output_token_ids.append(sampled)

    @precondition(lambda self: self.running)
    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        self._drop(self.running[pick % len(self.running)])

    @precondition(lambda self: self.running or self.waiting)
    @rule(pick=PICK)
    def abort(self, pick: int) -> None:
        seqs = self.running + self.waiting
        self._drop(seqs[pick % len(seqs)])

    @precondition(lambda self: self.running)
    @rule(pick=PICK)
    def preempt(self, pick: int) -> None:
        self._preempt(self.running[pick % len(self.running)])

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.scheduled.pop(seq.seq_id, None)
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    def _drop(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.scheduled.pop(seq.seq_id, None)
        (self.running if seq in self.running else self.waiting).remove(seq)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def accounting_holds(self) -> None:
        self.bm.check_invariants(self.running)
        assert all(not s.block_table and not s.window_tables for s in self.waiting)

    @invariant()
    def every_window_holds_its_own_prefix(self) -> None:
        for seq in self.running:
            tokens, computed = seq.all_token_ids(), seq.num_computed_tokens
            for window, table in zip(self.WINDOWS, seq.window_tables, strict=True):
                for pos in range(max(0, computed - window + 1), computed):
                    slot = (table[pos // BS], pos % BS)
                    assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (seq.seq_id, pos)

    @invariant()
    def every_computed_slot_holds_its_own_prefix(self) -> None:
        for seq in self.running:
            tokens = seq.all_token_ids()
            for pos in range(seq.num_computed_tokens):
                slot = (seq.block_table[pos // BS], pos % BS)
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (seq.seq_id, pos)

    @invariant()
    def no_two_sequences_write_the_same_block(self) -> None:
        written: dict[int, int] = {}
        for seq in self.running:
            start, num_tokens = seq.num_computed_tokens, self.scheduled.get(seq.seq_id, 1)
            for pos, table in itertools.product(
                range(start, start + num_tokens), (seq.block_table, *seq.window_tables)
            ):
                block = table[pos // BS] if pos // BS < len(table) else None
                if block is None:
                    continue  # the next decode slot, not allocated yet
                assert written.setdefault(block, seq.seq_id) == seq.seq_id, (block, seq.seq_id)
                others = [s for s in self.running if s is not seq and _holds(s, block)]
                assert not others, (block, seq.seq_id)


def _holds(seq: Sequence, block: int) -> bool:
    return any(block in table for table in (seq.block_table, *seq.window_tables))


class WindowPrefixCacheMachine(PrefixCacheMachine):
    """Two window groups of 3 and 4 tokens (a block and a half, two blocks) beside the full
    group, over a pool big enough for a few sequences of all three."""

    WINDOWS = (3, 4)
    NUM_BLOCKS = 16


def test_prefix_cache_under_random_interleavings() -> None:
    run_state_machine_as_test(PrefixCacheMachine, settings=MACHINE_SETTINGS)


def test_prefix_cache_under_random_interleavings_with_colliding_hashes() -> None:
    def weak_hash(parent: int, token_ids: tuple[int, ...]) -> int:
        return sum(token_ids) % 3  # most blocks collide; the parent is ignored

    with mock.patch("schedulers.block_manager.hash_block_tokens", weak_hash):
        run_state_machine_as_test(PrefixCacheMachine, settings=MACHINE_SETTINGS)


def test_window_groups_under_random_interleavings() -> None:
    run_state_machine_as_test(WindowPrefixCacheMachine, settings=MACHINE_SETTINGS)


def test_window_groups_under_random_interleavings_with_colliding_hashes() -> None:
    def weak_hash(parent: int, token_ids: tuple[int, ...]) -> int:
        return sum(token_ids) % 3

    with mock.patch("schedulers.block_manager.hash_block_tokens", weak_hash):
        run_state_machine_as_test(WindowPrefixCacheMachine, settings=MACHINE_SETTINGS)
