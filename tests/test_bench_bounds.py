"""The flat-step-cost ceiling of orca / static on a workload."""

from __future__ import annotations

import pytest

from bench.bounds import step_bound


def test_static_waits_for_the_longest_while_orca_refills_seats() -> None:
    # static: [4, 1] takes 4 steps, then [1, 1] one more; orca: 4 never waits for a seat
    bound = step_bound([4, 1, 1, 1], seats=2)
    assert (bound.static_steps, bound.orca_steps) == (5, 4)
    assert bound.ratio == pytest.approx(1.25)


def test_equal_lengths_or_one_batch_gain_nothing() -> None:
    assert step_bound([3] * 8, seats=4).ratio == 1.0
    assert step_bound([9, 1, 5], seats=8).ratio == 1.0


def test_one_seat_is_sequential_for_both() -> None:
    bound = step_bound([2, 7, 1], seats=1)
    assert bound.static_steps == bound.orca_steps == 10


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        step_bound([1, 0], seats=2)
    with pytest.raises(ValueError):
        step_bound([1], seats=0)
