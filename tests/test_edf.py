"""`edf`: earliest first-token deadline first (from the request or the arm's SLO), late
requests run last or are refused, and a late one is not passed over past its bound."""

from __future__ import annotations

import dataclasses
import time

import pytest

from schedulers.sequence import DEADLINE_EXCEEDED, FinishReason, Sequence
from tests.test_scheduler import make_scheduler, make_seq, run_step
from tests.test_sjf import admitted_order, waited


def due_in(seq: Sequence, deadline_ms: float) -> Sequence:
    seq.sampling_params = dataclasses.replace(seq.sampling_params, deadline_ms=deadline_ms)
    return seq


def test_the_earliest_deadline_is_admitted_first() -> None:
    sched = make_scheduler("edf", max_num_seqs=1)
    relaxed, urgent = due_in(make_seq(4, 3), 60_000), due_in(make_seq(4, 3), 500)
    default = make_seq(4, 3)  # the arm's TTFT SLO: 2000 ms
    for seq in (relaxed, default, urgent):
        sched.add(seq)
    assert admitted_order(sched) == [urgent, default, relaxed]


def test_the_arms_ttft_slo_is_the_deadline_of_requests_without_one() -> None:
    sched = make_scheduler("edf", max_num_seqs=1, edf_ttft_slo_ms=100)
    explicit, default = due_in(make_seq(4, 3), 1000), make_seq(4, 3)
    sched.add(explicit)
    sched.add(default)
    assert admitted_order(sched) == [default, explicit]


def test_a_principals_min_deadline_lifts_the_arms_slo_for_its_requests() -> None:
    sched = make_scheduler("edf", max_num_seqs=1, edf_ttft_slo_ms=100)
    capped, other = make_seq(4, 3), due_in(make_seq(4, 3), 1000)
    capped.sampling_params = dataclasses.replace(capped.sampling_params, min_deadline_ms=5000)
    sched.add(capped)
    sched.add(other)
    assert admitted_order(sched) == [other, capped]


def test_late_requests_run_after_the_on_time_ones() -> None:
    sched = make_scheduler("edf", max_num_seqs=1)
    late = waited(due_in(make_seq(4, 3), 100), 0.5)
    on_time = due_in(make_seq(4, 3), 5000)
    sched.add(late)
    sched.add(on_time)
    assert admitted_order(sched) == [on_time, late]


def test_a_late_request_waiting_past_the_bound_is_not_passed_over() -> None:
    sched = make_scheduler("edf", max_num_seqs=1, edf_max_wait_s=1.0)
    starving = waited(due_in(make_seq(4, 3), 100), 1.5)
    on_time = [due_in(make_seq(4, 3), 50) for _ in range(3)]
    for seq in (*on_time, starving):
        sched.add(seq)
    assert admitted_order(sched)[0] is starving


def test_refuse_finishes_late_requests_with_deadline_exceeded() -> None:
    sched = make_scheduler("edf", max_num_seqs=1, edf_late="refuse")
    late = waited(due_in(make_seq(4, 3), 100), 0.5)
    on_time = due_in(make_seq(4, 3), 5000)
    sched.add(late)
    sched.add(on_time)
    refused = sched.expire_waiting(time.monotonic())
    assert refused == [late]
    assert late.finish_reason is FinishReason.ERROR and late.error_code == DEADLINE_EXCEEDED
    assert admitted_order(sched) == [on_time]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_last_keeps_late_requests() -> None:
    sched = make_scheduler("edf", max_num_seqs=1)
    late = waited(due_in(make_seq(4, 3), 100), 0.5)
    sched.add(late)
    assert sched.expire_waiting(time.monotonic()) == []
    assert admitted_order(sched) == [late]


def test_with_a_tpot_slo_the_running_sequence_with_most_slack_is_preempted() -> None:
    # 6 blocks of 4 slots: three 4-token prompts fit, their decodes soon do not
    sched = make_scheduler("edf", num_blocks=6, max_num_seqs=3, edf_tpot_slo_ms=50)
    seqs = [make_seq(4, 12) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    admitted_order(sched, steps=1)
    seqs[0].first_token_time = time.monotonic() + 10  # the most slack by far
    preempted: list[Sequence] = []
    for _ in range(60):
        if not sched.has_work:
            break
        preempted += run_step(sched)[0].preempted
    assert preempted and preempted[0] is seqs[0]


def test_bad_options_are_refused() -> None:
    for bad in ({"edf_ttft_slo_ms": 0}, {"edf_tpot_slo_ms": -1}, {"edf_late": "drop"}):
        with pytest.raises(ValueError):
            make_scheduler("edf", **bad)  # type: ignore[arg-type]
