"""Prefix caching in the block manager: full blocks are shared, verified and evicted LRU."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest

from schedulers.block_manager import NO_HIT, BlockManager, PrefixHit
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(max_tokens=16))


def admit(bm: BlockManager, seq: Sequence) -> PrefixHit:
    """What the admission helper does: look up, take the hit, cover the rest of the tokens."""
    hit = bm.computed_prefix(seq)
    assert bm.can_allocate(seq, seq.num_tokens, hit)
    bm.allocate(seq, seq.num_tokens, hit)
    return hit


def compute(bm: BlockManager, seq: Sequence, *sampled: int) -> None:
    """A step that computes every scheduled token, then samples `sampled` (decode steps)."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    for token in sampled:
        seq.output_token_ids.append(token)
        bm.append(seq)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)


def caching_bm(num_blocks: int = 16) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=True)


def test_a_second_sequence_with_the_same_prompt_shares_its_full_blocks() -> None:
    bm = caching_bm()
    first, second = make_seq(list(range(10))), make_seq(list(range(10)))  # 2 full + 2 tokens
    assert admit(bm, first) == NO_HIT
    compute(bm, first)
    hit = admit(bm, second)
    assert hit == PrefixHit(tuple(first.block_table[:2]), 8)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]  # the partial block is its own
    assert second.num_computed_tokens == 8
    assert bm.num_used_blocks == 4
    bm.check_invariants([first, second])


def test_only_the_matching_part_of_a_prefix_is_a_hit() -> None:
    bm = caching_bm()
    first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, first)
    compute(bm, first)
    other = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 9])  # differs in the second block
    assert admit(bm, other) == PrefixHit((first.block_table[0],), 4)
    bm.check_invariants([first, other])


@pytest.mark.parametrize(
    ("prompt_len", "hit_tokens"),
    [(12, 8), (13, 12), (4, 0), (5, 4), (1, 0)],  # 12: every block cached, ends on a boundary
)
def test_a_hit_always_leaves_a_prompt_token_to_compute(prompt_len: int, hit_tokens: int) -> None:
    bm = caching_bm()
    first = make_seq(list(range(prompt_len)))
    admit(bm, first)
    compute(bm, first, 99)  # the prompt's full blocks are all cached now
    bm.free(first)
    again = make_seq(list(range(prompt_len)))
    hit = bm.computed_prefix(again)
    assert hit.num_tokens == hit_tokens < prompt_len
    bm.allocate(again, again.num_tokens, hit)
    assert again.num_computed_tokens == hit_tokens
    bm.check_invariants([again])


def test_a_recomputed_copy_of_a_cached_block_is_swapped_for_it() -> None:
    bm = caching_bm()
    first = make_seq(list(range(8)))  # exactly two blocks: the second is recomputed
    admit(bm, first)
    compute(bm, first, 99)
    again = make_seq(list(range(8)))
    admit(bm, again)
    own_copy = again.block_table[1]
    assert own_copy != first.block_table[1]
    compute(bm, again)
    assert again.block_table[:2] == first.block_table[:2]
    assert bm.num_used_blocks == 3  # first's two shared blocks and its decode block
    bm.check_invariants([first, again])
    bm.free(first)
    bm.free(again)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2


def test_choices_admitted_together_end_up_sharing_the_prompt_blocks() -> None:
    bm = caching_bm()
    choices = [make_seq(list(range(9))) for _ in range(3)]
    for choice in choices:
        admit(bm, choice)
    assert bm.num_used_blocks == 9  # nothing was cached yet: each has its own copy
    for choice in choices:
        compute(bm, choice)
    assert {tuple(c.block_table[:2]) for c in choices} == {tuple(choices[0].block_table[:2])}
    assert bm.num_used_blocks == 2 + 3
    bm.check_invariants(choices)


def test_output_tokens_are_cached_for_the_next_turn() -> None:
    bm = caching_bm()
    turn1 = make_seq([1, 2, 3, 4, 5, 6])
    admit(bm, turn1)
    compute(bm, turn1, 7, 8, 9, 10)  # 10 is sampled but never computed
    bm.free(turn1)
    turn2 = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert admit(bm, turn2).num_tokens == 8  # block [9, 10, ...] was never full and computed
    assert bm.prefix_cache_queries == 6 + 13 and bm.prefix_cache_hits == 8


def test_a_preempted_sequence_finds_its_blocks_again() -> None:
    bm = caching_bm()
    seq = make_seq(list(range(6)))
    admit(bm, seq)
    compute(bm, seq, 50, 51, 52, 53, 54)  # 11 tokens, 10 computed: two full blocks
    table = list(seq.block_table)
    bm.free(seq)  # preemption with recompute
    seq.num_computed_tokens = 0
    assert bm.num_cached_blocks == 2
    hit = bm.computed_prefix(seq)
    assert hit == PrefixHit(tuple(table[:2]), 8)
    bm.allocate(seq, seq.num_tokens, hit)
    assert seq.block_table[:2] == table[:2] and seq.num_computed_tokens == 8
    bm.check_invariants([seq])


def test_freed_blocks_stay_cached_and_count_as_free() -> None:
    bm = caching_bm()
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    compute(bm, seq)
    bm.free(seq)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2 and bm.usage == 0.0
    bm.check_invariants([])


def test_cached_blocks_are_evicted_only_when_nothing_else_is_free() -> None:
    bm = caching_bm(num_blocks=4)
    old = make_seq(list(range(8)))
    admit(bm, old)
    compute(bm, old, 99)  # blocks: two cached, one decode block
    bm.free(old)
    filler = make_seq([50])
    bm.allocate(filler, 1)  # truly free blocks go first
    assert bm.num_cached_blocks == 2
    bm.allocate(filler, 2 * 4 + 1)  # the last truly free one, then the prefix's end goes
    assert bm.num_cached_blocks == 1
    assert bm.computed_prefix(make_seq(list(range(8)) + [1])).num_tokens == 4
    bm.check_invariants([filler])


def test_the_least_recently_used_prefix_is_evicted_first() -> None:
    bm = caching_bm(num_blocks=4)
    a, b = make_seq([1, 1, 1, 1, 0]), make_seq([2, 2, 2, 2, 0])
    for seq in (a, b):
        admit(bm, seq)
        compute(bm, seq)
    bm.free(a)
    bm.free(b)
    reuse_a = make_seq([1, 1, 1, 1, 5])
    admit(bm, reuse_a)  # a's block is used again, so b's is now the least recent
    bm.free(reuse_a)
    bm.allocate(make_seq([9]), 4 * 3)  # needs every truly free block and one cached one
    assert bm.computed_prefix(make_seq([1, 1, 1, 1, 0])).num_tokens == 4
    assert bm.computed_prefix(make_seq([2, 2, 2, 2, 0])).num_tokens == 0


def test_a_hash_collision_never_serves_another_prefix() -> None:
    with mock.patch("schedulers.block_manager.hash_block_tokens", return_value=7):
        bm = caching_bm()
        first = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
        admit(bm, first)
        compute(bm, first)  # block 0 takes hash 7; block 1 collides and stays private
        other = make_seq([9, 9, 9, 9, 0])
        assert bm.computed_prefix(other) == NO_HIT  # same hash, other tokens
        same = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
        assert bm.computed_prefix(same) == PrefixHit((first.block_table[0],), 4)
        bm.check_invariants([first])


def test_equal_tokens_after_a_different_parent_are_not_a_hit() -> None:
    # a hash that ignores the parent: only the parent check tells these blocks apart
    with mock.patch("schedulers.block_manager.hash_block_tokens", side_effect=lambda _, t: hash(t)):
        bm = caching_bm()
        x_then_y = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 0])
        z_then_y = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0])
        for seq in (x_then_y, z_then_y):
            admit(bm, seq)
            compute(bm, seq)
        probe = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0])
        assert bm.computed_prefix(probe) == PrefixHit((z_then_y.block_table[0],), 4)
        bm.check_invariants([x_then_y, z_then_y])


def test_reservations_count_only_the_blocks_not_shared() -> None:
    bm = caching_bm()
    first = make_seq(list(range(9)))
    admit(bm, first)
    compute(bm, first)
    second = make_seq(list(range(9)))
    hit = bm.computed_prefix(second)
    assert bm.num_new_blocks(second, 9 + 16, hit) == 7 - 2  # worst case 7 blocks, 2 shared
    bm.free(first)  # the shared blocks are cached now: taking them takes them from the free
    hit = bm.computed_prefix(second)
    assert bm.num_new_blocks(second, 9 + 16, hit) == 7
    free_before = bm.num_free_blocks
    bm.allocate(second, 9 + 16, hit)
    assert bm.num_free_blocks == free_before - 7


def test_a_hit_that_went_stale_is_refused() -> None:
    bm = caching_bm(num_blocks=3)
    first = make_seq(list(range(5)))
    admit(bm, first)
    compute(bm, first)
    bm.free(first)
    seq = make_seq(list(range(5)))
    hit = bm.computed_prefix(seq)
    bm.allocate(make_seq([9]), 3 * BS)  # evicts the hit's block
    with pytest.raises(RuntimeError, match="stale prefix hit"):
        bm.allocate(seq, seq.num_tokens, hit)
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_a_shared_block_can_never_be_a_writable_one() -> None:
    bm = caching_bm()
    first = make_seq(list(range(9)))
    admit(bm, first)
    compute(bm, first)
    second = make_seq(list(range(9)))
    admit(bm, second)
    bm._release(second.block_table[2])  # corrupt: share first's partial block instead
    second.block_table[2] = first.block_table[2]
    bm._ref_counts[first.block_table[2]] += 1
    with pytest.raises(AssertionError, match="writable block shared"):
        bm.check_invariants([first, second])


def test_the_invariant_check_catches_a_block_both_free_and_held() -> None:
    bm = caching_bm()
    seq = make_seq(list(range(9)))
    admit(bm, seq)
    bm._free.append(seq.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants([seq])


def test_with_caching_off_nothing_is_looked_up_or_kept() -> None:
    bm = BlockManager(16, BS)
    first = make_seq(list(range(9)))
    admit(bm, first)
    compute(bm, first)
    second = make_seq(list(range(9)))
    assert admit(bm, second) == NO_HIT and second.num_computed_tokens == 0
    bm.free(first)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
    bm.check_invariants([second])
