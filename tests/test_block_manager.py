"""The paged KV block manager never over-commits and never loses a block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence


def seq(seq_id: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [1], SamplingParams())


def test_allocate_covers_the_requested_slots() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(0)
    bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.allocate(s, 12)  # still within three blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 4


def test_never_over_commits() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(0)
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(s, 9)
    assert bm.num_free_blocks == 2 and s.block_table == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans()), max_size=60))
def test_blocks_are_conserved_under_any_sequence_of_operations(
    ops: list[tuple[int, int, bool]],
) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    seqs = [seq(i) for i in range(6)]
    for index, num_tokens, free in ops:
        s = seqs[index]
        if free:
            bm.free(s)
        elif bm.can_allocate(s, num_tokens):
            bm.allocate(s, num_tokens)
        held = [b for x in seqs for b in x.block_table]
        assert len(held) == len(set(held))  # no block in two tables
        assert len(held) + bm.num_free_blocks == 16


class FifoFreeList:
    """The allocator before prefix caching: pop from the head, give back to the tail."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        table = self.tables.setdefault(seq_id, [])
        needed = max(0, -(-num_tokens // self.block_size) - len(table))
        if needed > len(self.free):
            return False
        table += self.free[:needed]
        del self.free[:needed]
        return True

    def free_seq(self, seq_id: int) -> None:
        self.free += self.tables.pop(seq_id, [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans()), max_size=60))
def test_with_caching_off_block_ids_come_and_go_as_from_a_fifo_free_list(
    ops: list[tuple[int, int, bool]],
) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    reference = FifoFreeList(16, 4)
    seqs = [seq(i) for i in range(6)]
    for index, num_tokens, free in ops:
        s = seqs[index]
        if free:
            bm.free(s)
            reference.free_seq(index)
        else:
            fits = bm.can_allocate(s, num_tokens)
            if fits:
                bm.allocate(s, num_tokens)
            assert reference.allocate(index, num_tokens) == fits
        s.num_computed_tokens = min(num_tokens, 4 * len(s.block_table))
        bm.cache_full_blocks(s)  # a no-op with caching off
        assert s.block_table == reference.tables.get(index, [])
        assert bm.num_free_blocks == len(reference.free) and bm.num_cached_blocks == 0
        bm.check_invariants(seqs)
