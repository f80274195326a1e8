"""Scheduler policies with no weights: who is admitted, when, and with how many tokens."""

from __future__ import annotations

import dataclasses
import time

import pytest

from schedulers.base import AdmissionError, Scheduler, SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.registry import available_schedulers, create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, SequenceStatus, TokenLogprob

_ids = iter(range(10**9))


def make_seq(prompt_len: int, max_tokens: int = 8) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def make_scheduler(
    name: str, num_blocks: int = 64, block_size: int = 4, **knobs: int | float | bool
) -> Scheduler:
    """The policy `name` with shared `knobs` in its config and its own ones as options."""
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)}
    config = SchedulerConfig(**{k: v for k, v in knobs.items() if k in shared})  # type: ignore[arg-type]
    options = {k: v for k, v in knobs.items() if k not in shared}
    return create_scheduler(name, config, BlockManager(num_blocks, block_size), options)


def run_step(scheduler: Scheduler) -> tuple[Batch, list[Sequence]]:
    """One iteration with a fake backend that samples token 7 for every completed seq."""
    batch = scheduler.schedule()
    out = ExecuteOutput(
        {
            seq.seq_id: TokenLogprob(7, 0.0)
            for i, seq in enumerate(batch.seqs)
            if batch.samples_after(i)
        }
    )
    return batch, scheduler.update(batch, out)


def ids(batch: Batch) -> list[int]:
    return [s.seq_id for s in batch.seqs]


@pytest.mark.parametrize("name", ["orca", "static"])
def test_prefill_then_decode_one_token_per_step(name: str) -> None:
    sched = make_scheduler(name)
    seq = make_seq(10, max_tokens=3)
    sched.add(seq)
    batch, _ = run_step(sched)
    assert batch.num_scheduled_tokens == [10]
    batch, _ = run_step(sched)
    assert batch.num_scheduled_tokens == [1]
    assert seq.num_computed_tokens == 11
    _, finished = run_step(sched)
    assert finished == [seq] and seq.output_token_ids == [7, 7, 7]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_orca_admits_into_a_running_batch() -> None:
    sched = make_scheduler("orca")
    first, second = make_seq(8), make_seq(5)
    sched.add(first)
    run_step(sched)
    sched.add(second)
    batch, _ = run_step(sched)
    assert ids(batch) == [first.seq_id, second.seq_id]
    assert batch.num_scheduled_tokens == [1, 5]  # a decode and a prefill share the iteration
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 5


def test_static_does_not_admit_until_the_batch_is_done() -> None:
    sched = make_scheduler("static")
    first, second = make_seq(8, max_tokens=3), make_seq(5, max_tokens=2)
    sched.add(first)
    run_step(sched)
    sched.add(second)
    for _ in range(2):
        batch, _ = run_step(sched)
        assert ids(batch) == [first.seq_id]
    batch, _ = run_step(sched)
    assert ids(batch) == [second.seq_id]


def test_static_seat_stays_empty_after_an_early_finish() -> None:
    sched = make_scheduler("static", max_num_seqs=2)
    short, long_, late = make_seq(4, max_tokens=1), make_seq(4, max_tokens=4), make_seq(4)
    sched.add(short)
    sched.add(long_)
    _, finished = run_step(sched)
    assert finished == [short]
    sched.add(late)
    while long_.status is not SequenceStatus.FINISHED:
        batch, _ = run_step(sched)
        assert ids(batch) == [long_.seq_id]  # the freed seat is not refilled
    batch, _ = run_step(sched)
    assert ids(batch) == [late.seq_id]


def test_orca_refills_a_seat_the_step_after_a_finish() -> None:
    sched = make_scheduler("orca", max_num_seqs=2)
    short, long_, late = make_seq(4, max_tokens=1), make_seq(4, max_tokens=4), make_seq(4)
    sched.add(short)
    sched.add(long_)
    run_step(sched)
    sched.add(late)
    batch, _ = run_step(sched)
    assert ids(batch) == [long_.seq_id, late.seq_id]


@pytest.mark.parametrize("name", ["orca", "static"])
def test_seat_limit_holds(name: str) -> None:
    sched = make_scheduler(name, max_num_seqs=3)
    for _ in range(7):
        sched.add(make_seq(4))
    for _ in range(30):
        batch, _ = run_step(sched)
        assert len(batch.seqs) <= 3
        assert len(sched.running) <= 3


@pytest.mark.parametrize("name", ["orca", "static"])
def test_token_budget_holds(name: str) -> None:
    sched = make_scheduler(name, max_num_batched_tokens=12)
    for _ in range(5):
        sched.add(make_seq(5))
    while sched.has_work:
        batch, _ = run_step(sched)
        assert batch.total_tokens <= 12


def test_orca_chunked_prefill_splits_a_long_prompt_under_the_budget() -> None:
    sched = make_scheduler("orca", max_num_batched_tokens=8, enable_chunked_prefill=True)
    decoding, long_ = make_seq(4, max_tokens=20), make_seq(20)
    sched.add(decoding)
    run_step(sched)
    sched.add(long_)
    chunks = []
    while long_.num_output_tokens == 0:
        batch, _ = run_step(sched)
        assert batch.total_tokens <= 8
        chunks.append(batch.num_scheduled_tokens[-1])
    assert sum(chunks) == 20 and len(chunks) == 3  # 7 + 7 + 6 beside one decode each


def test_a_prompt_longer_than_the_budget_still_runs_alone() -> None:
    sched = make_scheduler("orca", max_num_batched_tokens=8)
    seq = make_seq(20, max_tokens=2)
    sched.add(seq)
    while not seq.is_finished:
        batch, _ = run_step(sched)
        assert batch.total_tokens <= 8
    assert seq.output_token_ids == [7, 7]


def test_static_waits_for_the_batch_to_fill() -> None:
    sched = make_scheduler("static", max_num_seqs=4, batch_wait_ms=80)
    sched.add(make_seq(4))
    batch, _ = run_step(sched)
    assert batch.is_empty and sched.next_wakeup() is not None
    time.sleep(0.1)
    batch, _ = run_step(sched)
    assert len(batch.seqs) == 1


def test_static_forms_at_once_when_the_batch_is_full() -> None:
    sched = make_scheduler("static", max_num_seqs=2, batch_wait_ms=10_000)
    sched.add(make_seq(4))
    sched.add(make_seq(4))
    batch, _ = run_step(sched)
    assert len(batch.seqs) == 2


def test_static_max_batch_size_caps_a_batch_below_max_num_seqs() -> None:
    sched = make_scheduler("static", max_num_seqs=8, max_batch_size=2, batch_wait_ms=10_000)
    for _ in range(3):
        sched.add(make_seq(4))
    batch, _ = run_step(sched)  # two waiting fill a batch of 2: it forms without waiting
    assert len(batch.seqs) == 2 and len(sched.waiting) == 1


def test_static_align_prompts_runs_a_batch_at_its_shortest_prompt() -> None:
    sched = make_scheduler("static", max_num_seqs=2, align_prompts=True)
    short, long_ = make_seq(4, max_tokens=2), make_seq(7, max_tokens=2)
    sched.add(short)
    sched.add(long_)
    batch, _ = run_step(sched)  # both prefill 4 tokens; only the short one samples
    assert batch.num_scheduled_tokens == [4, 4] and short.output_token_ids == [7]
    assert long_.output_token_ids == []
    for _ in range(3):  # the long one feeds its last 3 prompt tokens one per step
        batch, _ = run_step(sched)
        assert batch.num_scheduled_tokens[-1] == 1
    assert long_.output_token_ids == [7] and short.is_finished
    _, finished = run_step(sched)
    assert finished == [long_]


def test_static_rejects_bad_batch_options() -> None:
    with pytest.raises(ValueError, match="num_microbatches"):
        make_scheduler("static", num_microbatches=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        make_scheduler("static", max_batch_size=-1)


def test_static_reserves_worst_case_kv_at_formation() -> None:
    # 8 blocks of 4 slots: each request needs (4 + 8) / 4 = 3 blocks at worst
    sched = make_scheduler("static", num_blocks=8, max_num_seqs=4)
    seqs = [make_seq(4, max_tokens=8) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch, _ = run_step(sched)
    assert len(batch.seqs) == 2
    while sched.has_work:
        run_step(sched)
    assert all(s.num_output_tokens == 8 for s in seqs)


def test_orca_preempts_the_most_recent_and_recomputes() -> None:
    # 6 blocks of 4 slots: two sequences of 8 + 8 tokens need 4 blocks each at the end
    sched = make_scheduler("orca", num_blocks=6)
    first, second = make_seq(8, max_tokens=8), make_seq(8, max_tokens=8)
    sched.add(first)
    sched.add(second)
    preempted: list[Sequence] = []
    while sched.has_work:
        batch, _ = run_step(sched)
        preempted += batch.preempted
    assert preempted and all(s is second for s in preempted)
    assert second.num_preemptions >= 1 and sched.num_preemptions == len(preempted)
    assert first.output_token_ids == second.output_token_ids == [7] * 8
    assert sched.block_manager.num_free_blocks == 6


def test_a_request_that_cannot_fit_alone_is_rejected_at_admission() -> None:
    sched = make_scheduler("orca", num_blocks=4, block_size=4)  # 16 slots in all
    with pytest.raises(AdmissionError, match="KV cache"):
        sched.add(make_seq(10, max_tokens=10))
    assert not sched.has_work


def test_context_window_is_enforced_at_admission() -> None:
    sched = make_scheduler("orca", max_model_len=32)
    with pytest.raises(AdmissionError) as info:
        sched.add(make_seq(30, max_tokens=5))
    assert info.value.code == "context_length_exceeded"
    assert "32" in str(info.value)


@pytest.mark.parametrize("name", ["orca", "static"])
def test_abort_frees_blocks_of_running_and_waiting(name: str) -> None:
    sched = make_scheduler(name, max_num_seqs=1)
    running, waiting = make_seq(9), make_seq(9)
    sched.add(running)
    sched.add(waiting)
    run_step(sched)
    assert running.block_table
    assert sched.abort(running.seq_id) is running
    assert sched.abort(waiting.seq_id) is waiting
    assert sched.abort(12345678) is None
    assert not sched.has_work
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_unknown_scheduler_name_is_a_clear_error() -> None:
    listed = ", ".join(available_schedulers())
    assert {"orca", "static", "lpm", "priority"} <= set(available_schedulers())
    with pytest.raises(ValueError, match=f"unknown scheduler 'fifo'; available: {listed}"):
        make_scheduler("fifo")
