"""The verdict's three outcomes on samples whose truth is known, and the same-schedule flag."""

from __future__ import annotations

import numpy as np

from bench.schedule import same_schedule
from bench.trace import ArmTrace
from bench.verdict import METRICS, METRICS_BY_KEY, RunSample, compare_runs

E2E = [METRICS_BY_KEY["e2e_p50"]]


def sample(e2e: np.ndarray) -> RunSample:
    n = e2e.size
    return RunSample(
        ttft_ms=e2e / 10, tpot_ms=e2e / 100, e2e_ms=e2e, output_tokens=np.full(n, 100.0),
        good=np.ones(n), itl_ms=np.repeat(e2e / 100, 2), itl_request=np.repeat(np.arange(n), 2),
        duration_s=None,
    )  # fmt: skip


def verdict(base: np.ndarray, arm: np.ndarray, seed: int = 0, **kw: object) -> dict:
    (entry,) = compare_runs(
        "static", [sample(base)], "orca", [sample(arm)], slo_active=False,
        rng=np.random.default_rng(seed), num_resamples=1000, paired=False, metrics=E2E, **kw,
    )  # fmt: skip
    return entry


def draw(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(np.log(1000), 0.5, n) * scale


def test_equal_distributions_at_large_n_are_equivalent() -> None:
    entry = verdict(draw(20000, 1), draw(20000, 2))
    assert entry["outcome"] == "equivalent"
    assert entry["sentence"].startswith("no difference in p50 e2e larger than 5%")


def test_a_20_percent_shift_is_a_difference_not_an_equivalence() -> None:
    entry = verdict(draw(2000, 1), draw(2000, 2, scale=1.2))
    assert entry["outcome"] == "difference"
    assert entry["equivalent"] is False
    assert entry["sentence"].startswith("orca raises p50 e2e by")


def test_small_samples_are_inconclusive() -> None:
    outcomes = [verdict(draw(30, s), draw(30, s + 100), seed=s)["outcome"] for s in range(20)]
    assert outcomes.count("inconclusive") >= 15
    assert "equivalent" not in outcomes
    entry = next(verdict(draw(30, s), draw(30, s + 100), seed=s) for s in range(20))
    if entry["outcome"] == "inconclusive":
        assert entry["sentence"].startswith("inconclusive on p50 e2e")


def test_a_wider_margin_turns_inconclusive_into_equivalent() -> None:
    base, arm = draw(300, 1), draw(300, 2)
    assert verdict(base, arm)["outcome"] == "inconclusive"
    assert verdict(base, arm, margin=0.5)["outcome"] == "equivalent"


def test_an_arm_against_itself_reads_no_difference_on_every_metric() -> None:
    run = sample(draw(500, 3))
    rows = compare_runs(
        "orca", [run], "orca", [run], slo_active=True, rng=np.random.default_rng(0),
        num_resamples=500, metrics=METRICS,
    )  # fmt: skip
    for row in rows:
        if row["metric"] == "output_throughput":  # one run: no interval at all
            assert row["outcome"] is None
            continue
        assert row["outcome"] == "equivalent", row
        assert row["sentence"].startswith("no difference in "), row["sentence"]


def trace(shape: list[tuple[int, int, int]], start: float = 0.0) -> ArmTrace:
    iterations = [
        {"start": start + 0.01 * i + 0.003 * (i % 3), "duration_s": 0.01 + 0.001 * (i % 2),
         "seq_ids": list(range(n)), "num_prefill_tokens": p, "num_decode_tokens": d}
        for i, (n, p, d) in enumerate(shape)
    ]  # fmt: skip
    return ArmTrace(iterations, max_num_seqs=8, starts_in_window=True)


def test_same_schedule_ignores_timings_but_not_the_shape() -> None:
    shape = [(2, 64, 0), (2, 0, 2), (3, 30, 2), (3, 0, 3)]
    assert same_schedule([trace(shape)], [trace(shape, start=5.0)]) is True
    changed = [*shape[:2], (2, 0, 2), (3, 30, 2)]
    assert same_schedule([trace(shape)], [trace(changed)]) is False
    assert same_schedule([trace(shape)], [trace(shape[:-1])]) is False


def test_same_schedule_is_unknown_without_a_whole_trace() -> None:
    shape = [(1, 10, 0), (1, 0, 1)]
    missing = ArmTrace(note="trace fetching was turned off (--no-trace)")
    truncated = ArmTrace(trace(shape).iterations, 8, starts_in_window=True, truncated=True)
    assert same_schedule([trace(shape)], [missing]) is None
    assert same_schedule([trace(shape)], [truncated]) is None
    assert same_schedule([], []) is None


def test_a_significant_difference_inside_the_margin_reads_equivalent() -> None:
    base = draw(2000, 4)
    (entry,) = compare_runs(
        "static", [sample(base)], "orca", [sample(base * 1.005)], slo_active=False,
        rng=np.random.default_rng(0), num_resamples=1000, paired=True, metrics=E2E,
    )  # fmt: skip
    assert entry["significant"] is True  # paired: the 0.5% shift is certain
    assert entry["outcome"] == "equivalent"
    assert entry["sentence"].startswith("no difference in p50 e2e larger than 5%")
