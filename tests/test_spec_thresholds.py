"""schedulers/spec_decode/thresholds.py: break-even acceptance and `max_concurrency` from step
times, on synthetic times with known answers."""

from __future__ import annotations

import pytest

from schedulers.spec_decode import thresholds


def synthetic(cost_per_draft: dict[int, float]) -> dict[tuple[int, int], float]:
    """Step times where a row's k drafts cost `cost_per_draft[B] * k` of a plain step."""
    return {(rows, k): 1.0 + share * k for rows, share in cost_per_draft.items() for k in range(5)}


def test_expected_accepted_sums_the_chain_of_acceptances() -> None:
    assert thresholds.expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert thresholds.expected_accepted(1.0, 4) == 4
    assert thresholds.expected_accepted(0.0, 4) == 0


def test_break_even_is_the_cost_ratio_less_one() -> None:
    times = {(1, 0): 0.010, (1, 2): 0.012, (4, 0): 0.020, (4, 1): 0.030, (8, 3): 0.5}
    assert thresholds.break_even(times) == pytest.approx({(1, 2): 0.2, (4, 1): 0.5})


def test_best_k_is_the_largest_expected_gain() -> None:
    # per-draft acceptance 0.5: k drafts yield 0.5, 0.75, 0.875, 0.9375 against 0.2 k
    times = synthetic({1: 0.2})
    k, margin = thresholds.best_k(times, 1, 0.5)
    assert (k, margin) == (2, pytest.approx(0.75 - 0.4))
    assert thresholds.best_k(synthetic({1: 1.2}), 1, 0.5) == (0, 0.0)


def test_max_concurrency_is_the_last_row_count_that_pays() -> None:
    # at p = 0.5 one draft yields 0.5 accepted: it pays while a draft costs under 0.5 of a step
    times = synthetic({1: 0.01, 2: 0.05, 4: 0.2, 8: 0.45, 16: 0.6, 32: 0.9})
    assert thresholds.max_concurrency(times, 0.5) == 8
    assert thresholds.max_concurrency(times, 0.95) is None  # 0.95 accepted beats 0.9


def test_max_concurrency_none_when_it_always_pays_and_zero_when_never() -> None:
    assert thresholds.max_concurrency(synthetic({1: 0.01, 64: 0.1}), 0.8) is None
    assert thresholds.max_concurrency(synthetic({1: 2.0, 64: 3.0}), 0.8) == 0


def test_a_row_count_that_pays_after_one_that_does_not_is_not_counted() -> None:
    """Noise that makes a larger B look cheap does not lift the threshold past a B that lost."""
    times = synthetic({1: 0.1, 2: 0.9, 4: 0.1})
    assert thresholds.max_concurrency(times, 0.5) == 1


def test_the_threshold_for_one_draft_length_ignores_the_others() -> None:
    # k = 1 pays everywhere at p = 0.8 (cost 0.3 of a step); k = 4 costs 0.4 k at B = 32,
    # 1.6 against 0.8 + 0.64 + 0.512 + 0.41 = 2.36 accepted, and 0.9 k at B = 64
    times = synthetic({8: 0.1, 32: 0.4, 64: 0.9})
    times.update({(rows, 1): 1.3 for rows in (8, 32, 64)})
    assert thresholds.max_concurrency(times, 0.8) is None
    assert thresholds.max_concurrency(times, 0.8, only_k=4) == 32
