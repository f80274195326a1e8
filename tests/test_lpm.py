"""`lpm`: orca's loop, admitting the longest cached prefix first, with no starvation."""

from __future__ import annotations

import pytest

from schedulers.policies.lpm import LpmOptions
from schedulers.sequence import SequenceStatus
from tests.test_prefix_cache_scheduler import (
    PROMPT,
    make_scheduler,
    make_seq,
    run_step,
    run_until_done,
)


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    sched = make_scheduler("lpm", max_num_seqs=2)
    sched.add(make_seq(PROMPT, max_tokens=1))
    run_until_done(sched)
    cold, warm = make_seq([200 + t for t in PROMPT]), make_seq([*PROMPT[:16], 5])
    blocker = make_seq([300], max_tokens=3)
    sched.add(blocker)
    run_step(sched)
    sched.add(cold)
    sched.add(warm)
    batch, _ = run_step(sched)
    assert warm in batch.seqs and cold not in batch.seqs  # one seat left: the hit wins


def test_orca_stays_first_come_first_served() -> None:
    sched = make_scheduler("orca", max_num_seqs=2)
    sched.add(make_seq(PROMPT, max_tokens=1))
    run_until_done(sched)
    cold, warm = make_seq([200 + t for t in PROMPT]), make_seq([*PROMPT[:16], 5])
    sched.add(make_seq([300], max_tokens=3))
    run_step(sched)
    sched.add(cold)
    sched.add(warm)
    batch, _ = run_step(sched)
    assert cold in batch.seqs and warm not in batch.seqs


@pytest.mark.parametrize("max_skips", [0, 1, 3])
def test_lpm_passes_a_request_over_at_most_max_skips_times(max_skips: int) -> None:
    sched = make_scheduler("lpm", max_num_seqs=1, max_skips=max_skips)
    sched.add(make_seq(PROMPT, max_tokens=1))
    run_until_done(sched)
    cold = make_seq([200 + t for t in PROMPT], max_tokens=1)
    sched.add(cold)
    passed_over = 0
    for i in range(max_skips + 3):
        sched.add(make_seq([*PROMPT[:16], i], max_tokens=1))  # always a better match
        batch, _ = run_step(sched)
        if cold in batch.seqs:
            break
        passed_over += 1
    assert cold.status is not SequenceStatus.WAITING
    assert passed_over == max_skips


def test_lpm_is_fcfs_without_a_cache() -> None:
    sched = make_scheduler("lpm", caching=False, max_num_seqs=1)
    seqs = [make_seq([*PROMPT[: 4 * i], 9], max_tokens=1) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    order = [run_step(sched)[0].seqs[0] for _ in seqs]
    assert order == seqs


def test_lpm_refuses_a_negative_max_skips() -> None:
    with pytest.raises(ValueError, match="max_skips"):
        LpmOptions(max_skips=-1)
