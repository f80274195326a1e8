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
