"""Admission through the prefix cache, under every built-in policy, with no weights.

A fake backend samples token 7 for every sequence that completes its scheduled tokens; the
block accounting is checked after every step, finish and abort.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from schedulers.base import Scheduler, SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob

BS = 4
POLICIES = ["orca", "static", "lpm"]
_ids = itertools.count()


def make_seq(tokens: list[int], max_tokens: int = 4, leader: Sequence | None = None) -> Sequence:
    seq_id = next(_ids)
    request_id = leader.request_id if leader else f"r{seq_id}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    index = 1 if leader else 0
    return Sequence(seq_id, request_id, list(tokens), params, index=index, leader=leader)


def make_scheduler(
    name: str, num_blocks: int = 64, caching: bool = True, **knobs: int | float | bool
) -> Scheduler:
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)}
    config = SchedulerConfig(  # type: ignore[arg-type]
        enable_prefix_caching=caching, **{k: v for k, v in knobs.items() if k in shared}
    )
    options = {k: v for k, v in knobs.items() if k not in shared}
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return create_scheduler(name, config, bm, options)


def check(sched: Scheduler) -> None:
    sched.block_manager.check_invariants(sched.running)
    assert all(not s.block_table for s in sched.waiting)


def run_step(sched: Scheduler) -> tuple[Batch, list[Sequence]]:
    batch = sched.schedule()
    check(sched)
    sampled = {
        s.seq_id: TokenLogprob(7, 0.0) for i, s in enumerate(batch.seqs) if batch.samples_after(i)
    }
    finished = sched.update(batch, ExecuteOutput(sampled))
    check(sched)
    return batch, finished


def run_until_done(sched: Scheduler, limit: int = 500) -> list[Batch]:
    batches = []
    for _ in range(limit):
        if not sched.has_work:
            return batches
        batches.append(run_step(sched)[0])
    raise AssertionError("the scheduler did not drain")


def scheduled(batch: Batch, seq: Sequence) -> int:
    return sum(n for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True) if s is seq)


PROMPT = list(range(1, 19))  # 18 tokens: four full blocks and two tokens


@pytest.mark.parametrize("name", POLICIES)
def test_a_later_request_computes_only_what_is_not_cached(name: str) -> None:
    sched = make_scheduler(name)
    first = make_seq(PROMPT)
    sched.add(first)
    run_until_done(sched)
    second = make_seq([*PROMPT[:16], 90, 91, 92])  # shares the first four blocks
    sched.add(second)
    batch, _ = run_step(sched)
    assert scheduled(batch, second) == 3 and batch.num_cached_tokens == 16
    assert second.num_cached_tokens == 16
    assert sched.block_manager.prefix_cache_hits == 16
    assert sched.block_manager.prefix_cache_queries == 18 + 19
    run_until_done(sched)
    assert second.output_token_ids == [7] * 4
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("name", POLICIES)
def test_with_caching_off_every_prompt_token_is_computed(name: str) -> None:
    sched = make_scheduler(name, caching=False)
    seqs = [make_seq(PROMPT) for _ in range(3)]
    prefill = 0
    for seq in seqs:
        sched.add(seq)
        prefill += sum(b.num_prefill_tokens for b in run_until_done(sched))
    assert prefill == 3 * len(PROMPT)
    assert all(s.num_cached_tokens == 0 for s in seqs)
    bm = sched.block_manager
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == bm.num_cached_blocks == 0


def schedule_trace(
    name: str, caching: bool, prompts: list[list[int]], num_blocks: int
) -> list[tuple[object, ...]]:
    """Every step's members (by arrival), token counts, preemptions and block tables."""
    sched = make_scheduler(name, num_blocks=num_blocks, caching=caching, max_num_seqs=3)
    order: dict[int, int] = {}
    for prompt in prompts:
        seq = make_seq(prompt, max_tokens=6)
        order[seq.seq_id] = len(order)
        sched.add(seq)
    steps: list[tuple[object, ...]] = []
    while sched.has_work:
        batch, _ = run_step(sched)
        members = [order[s.seq_id] for s in batch.seqs]
        tables = [list(s.block_table) for s in batch.seqs]
        preempted = [order[s.seq_id] for s in batch.preempted]
        steps.append((members, batch.num_scheduled_tokens, preempted, tables))
    return steps


@pytest.mark.parametrize("name", POLICIES)
def test_caching_off_ignores_what_the_prompts_share(name: str) -> None:
    """Off, equal prompts are scheduled exactly as distinct ones (same batches, same block
    ids, step for step, preemptions included); on, prompts that never hit are scheduled as
    off schedules them."""
    same = [PROMPT] * 4
    distinct = [[p + 100 * i for p in PROMPT] for i in range(4)]
    off = schedule_trace(name, False, same, num_blocks=11)
    assert off == schedule_trace(name, False, distinct, num_blocks=11)
    assert any(step[2] for step in off) or name == "static"  # preemption was exercised
    off, on = (schedule_trace(name, c, distinct, num_blocks=12) for c in (False, True))
    assert [step[:3] for step in off] == [step[:3] for step in on]


@pytest.mark.parametrize("name", POLICIES)
def test_chunked_prefill_starts_after_the_hit(name: str) -> None:
    sched = make_scheduler(name, max_num_batched_tokens=3, enable_chunked_prefill=True)
    first = make_seq(PROMPT)
    sched.add(first)
    run_until_done(sched)
    second = make_seq([*PROMPT[:16], 50, 51, 52, 53, 54, 55, 56])
    sched.add(second)
    chunks = []
    while not second.output_token_ids:
        batch, _ = run_step(sched)
        chunks.append(scheduled(batch, second))
    assert chunks == [3, 3, 1] and second.num_cached_tokens == 16


def test_a_preempted_sequence_finds_its_blocks_again() -> None:
    sched = make_scheduler("orca")
    seq = make_seq(PROMPT, max_tokens=10)
    sched.add(seq)
    for _ in range(5):
        run_step(sched)
    table, num_tokens = list(seq.block_table), seq.num_tokens
    assert (seq.num_computed_tokens, num_tokens) == (22, 23)  # five full blocks computed
    sched._preempt(seq, Batch(0))  # type: ignore[attr-defined]
    check(sched)
    batch, _ = run_step(sched)
    assert seq.block_table[:5] == table[:5]
    assert scheduled(batch, seq) == num_tokens - 20 and batch.num_cached_tokens == 20
    assert seq.num_cached_tokens == 0  # what the request was served at its first admission


@pytest.mark.parametrize("name", POLICIES)
def test_later_choices_start_from_the_first_choices_prompt(name: str) -> None:
    sched = make_scheduler(name)
    leader = make_seq(PROMPT)
    followers = [make_seq(PROMPT, leader=leader) for _ in range(2)]
    for seq in (leader, *followers):
        sched.add(seq)
    batches = run_until_done(sched)
    # the prompt's four full blocks are computed once; each follower computes its last 2
    assert sum(b.num_prefill_tokens for b in batches) == 18 + 2 + 2
    assert all(f.num_cached_tokens == 16 for f in followers)
    assert all(s.output_token_ids == [7] * 4 for s in (leader, *followers))
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("name", POLICIES)
def test_later_choices_do_not_wait_for_a_finished_leader(name: str) -> None:
    sched = make_scheduler(name)
    leader = make_seq(PROMPT)
    follower = make_seq(PROMPT, leader=leader)
    sched.add(leader)
    sched.add(follower)
    sched.abort(leader.seq_id)
    batch, _ = run_step(sched)
    assert scheduled(batch, follower) == 18


@pytest.mark.parametrize("caching", [True, False])
def test_static_reserves_only_the_blocks_a_member_does_not_share(caching: bool) -> None:
    # a member needs 7 blocks at worst (17 + 10 tokens), or 3 more once the 4 cached blocks
    # of the shared prefix are taken: 7 + 3 + 3 fit in 13 blocks, 7 + 7 do not
    sched = make_scheduler("static", num_blocks=13, caching=caching, max_num_seqs=4)
    warm = make_seq(PROMPT, max_tokens=1)
    sched.add(warm)
    run_until_done(sched)
    members = [make_seq([*PROMPT[:16], 60 + i], max_tokens=10) for i in range(3)]
    for seq in members:
        sched.add(seq)
    batch, _ = run_step(sched)
    assert len(batch.seqs) == (3 if caching else 1)
    run_until_done(sched)
    assert all(s.output_token_ids == [7] * 10 for s in members)


@pytest.mark.parametrize("name", POLICIES)
def test_blocks_are_all_free_after_finish_and_abort(name: str) -> None:
    sched = make_scheduler(name, num_blocks=16, max_num_seqs=3)
    seqs = [make_seq([*PROMPT[: 4 * (i % 4)], 40 + i], max_tokens=3 + i) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)
    run_step(sched)
    for seq in seqs[::2]:
        sched.abort(seq.seq_id)
        check(sched)
    run_until_done(sched)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    bm.check_invariants([])
