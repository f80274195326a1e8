"""`sjf` and `hrrn`: shortest predicted job first, with an online output-length estimate,
the response ratio, and the aging bound past which nobody is passed over."""

from __future__ import annotations

import time

import pytest

from schedulers.base import Scheduler
from schedulers.sequence import Sequence
from tests.test_scheduler import make_scheduler, make_seq, run_step


def admitted_order(sched: Scheduler, steps: int = 400) -> list[Sequence]:
    """Sequences in the order they were first scheduled, running until idle."""
    order: list[Sequence] = []
    for _ in range(steps):
        if not sched.has_work:
            break
        batch, _ = run_step(sched)
        order += [s for s in batch.seqs if s not in order]
    return order


def waited(seq: Sequence, seconds: float) -> Sequence:
    seq.arrival_time = time.monotonic() - seconds
    return seq


@pytest.mark.parametrize("name", ["sjf", "hrrn"])
def test_the_shortest_predicted_job_is_admitted_first(name: str) -> None:
    sched = make_scheduler(name, max_num_seqs=1)
    long, mid, short = make_seq(4, 40), make_seq(4, 10), make_seq(4, 2)
    for seq in (long, mid, short):
        sched.add(seq)
    assert admitted_order(sched) == [short, mid, long]


def test_sjf_weighs_the_prompt_as_a_fraction_of_a_decode_step() -> None:
    sched = make_scheduler("sjf", max_num_seqs=1, sjf_prefill_weight=0.5)
    long_prompt, short_prompt = make_seq(40, 4), make_seq(4, 10)  # 24 against 12 steps
    sched.add(long_prompt)
    sched.add(short_prompt)
    assert admitted_order(sched) == [short_prompt, long_prompt]


def test_sjf_learns_the_output_length_of_a_prompt_bucket() -> None:
    sched = make_scheduler("sjf", max_num_seqs=1, sjf_min_samples=2, num_blocks=256)
    for _ in range(2):  # 8-token prompts that stop at once (EOS) though allowed 100
        seq = make_seq(8, 100)
        seq.eos_token_ids = frozenset({7})
        sched.add(seq)
    admitted_order(sched)
    learned, unknown = make_seq(8, 100), make_seq(64, 20)
    sched.add(unknown)
    sched.add(learned)
    # without the estimate, 20 output tokens would be shorter than 100
    assert admitted_order(sched)[0] is learned


@pytest.mark.parametrize(
    ("name", "bound"), [("sjf", "sjf_max_wait_s"), ("hrrn", "hrrn_max_wait_s")]
)
def test_an_overdue_job_is_never_passed_over_by_a_shorter_one(name: str, bound: str) -> None:
    sched = make_scheduler(name, max_num_seqs=1, **{bound: 1.0})
    old_long = waited(make_seq(4, 50), 1.5)
    fresh = [make_seq(4, 1) for _ in range(3)]
    for seq in (*fresh, old_long):
        sched.add(seq)
    assert admitted_order(sched)[0] is old_long


def test_under_the_bound_a_long_job_waits_for_the_short_ones() -> None:
    sched = make_scheduler("sjf", max_num_seqs=1, sjf_max_wait_s=60.0)
    old_long = waited(make_seq(4, 50), 1.5)
    fresh = [make_seq(4, 1) for _ in range(3)]
    for seq in (*fresh, old_long):
        sched.add(seq)
    assert admitted_order(sched)[-1] is old_long


def test_hrrn_lets_a_long_wait_overtake_a_shorter_fresh_job() -> None:
    # ratio of the old job: (2 s + 20 x 10 ms) / 0.2 s = 11; of the fresh one: 1
    sched = make_scheduler("hrrn", max_num_seqs=1, hrrn_step_ms=10.0)
    old = waited(make_seq(4, 20), 2.0)
    fresh = make_seq(4, 2)
    sched.add(fresh)
    sched.add(old)
    assert admitted_order(sched) == [old, fresh]
    sjf = make_scheduler("sjf", max_num_seqs=1)
    old, fresh = waited(make_seq(4, 20), 2.0), make_seq(4, 2)
    sjf.add(fresh)
    sjf.add(old)
    assert admitted_order(sjf) == [fresh, old]


@pytest.mark.parametrize("name", ["sjf", "hrrn"])
def test_blocks_are_all_returned(name: str) -> None:
    sched = make_scheduler(name, num_blocks=8, max_num_seqs=4)
    for n in (3, 9, 1, 5, 2):
        sched.add(make_seq(4, n))
    assert len(admitted_order(sched)) == 5
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_bad_options_are_refused() -> None:
    for bad in ({"sjf_max_wait_s": 0}, {"sjf_prefill_weight": -1}, {"sjf_min_samples": 0}):
        with pytest.raises(ValueError):
            make_scheduler("sjf", **bad)
    with pytest.raises(ValueError):
        make_scheduler("hrrn", hrrn_step_ms=0)
