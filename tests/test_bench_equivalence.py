"""The verdict's three outcomes on samples whose truth is known, one run per arm read as
unreplicated, and the same-schedule flag."""

from __future__ import annotations

import numpy as np

from bench.schedule import same_schedule
from bench.trace import ArmTrace
from bench.verdict import METRICS, METRICS_BY_KEY, ONE_RUN_CAVEAT, RunSample, compare_runs

E2E = [METRICS_BY_KEY["e2e_p50"]]


def sample(e2e: np.ndarray) -> RunSample:
    n = e2e.size
    return RunSample(
        ttft_ms=e2e / 10, tpot_ms=e2e / 100, e2e_ms=e2e, output_tokens=np.full(n, 100.0),
        good=np.ones(n), itl_ms=np.repeat(e2e / 100, 2), itl_request=np.repeat(np.arange(n), 2),
        duration_s=None,
    )  # fmt: skip


def verdict(base: np.ndarray, arm: np.ndarray, seed: int = 0, **kw: object) -> dict:
    """Independent draws with no run-level shift: as two arms serving side by side."""
    (entry,) = compare_runs(
        "static", [sample(base)], "orca", [sample(arm)], slo_active=False,
        rng=np.random.default_rng(seed), num_resamples=1000, paired=False, metrics=E2E,
        simultaneous=True, **kw,
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
    runs = [sample(draw(500, 3)), sample(draw(500, 4))]
    rows = compare_runs(
        "orca", runs, "orca", runs, slo_active=True, rng=np.random.default_rng(0),
        num_resamples=500, metrics=METRICS,
    )  # fmt: skip
    for row in rows:
        if row["metric"] == "output_throughput":  # no durations: no interval at all
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
    base = [draw(2000, 4), draw(2000, 5)]
    (entry,) = compare_runs(
        "static", [sample(b) for b in base], "orca", [sample(b * 1.005) for b in base],
        slo_active=False, rng=np.random.default_rng(0), num_resamples=1000, paired=True,
        metrics=E2E,
    )  # fmt: skip
    assert entry["significant"] is True  # paired: the 0.5% shift is certain
    assert entry["outcome"] == "equivalent"
    assert entry["sentence"].startswith("no difference in p50 e2e larger than 5%")


def one_run_each(shift: float, n: int = 2000, **kw: object) -> dict:
    """The bench's one run per arm, paired: one workload (request i's own size), each run with
    its own per-request noise, the candidate's run `shift` times slower as a whole (the load
    on the machine while it ran, not the policy: the two arms are the same)."""
    workload = draw(n, 10)
    noise = np.random.default_rng(11).lognormal(0, 0.2, (2, n))
    (entry,) = compare_runs(
        "orca", [sample(workload * noise[0])], "orca-again", [sample(workload * noise[1] * shift)],
        slo_active=False, rng=np.random.default_rng(0), num_resamples=1000, metrics=E2E, **kw,
    )  # fmt: skip
    return entry


def test_one_run_per_arm_does_not_call_a_run_level_shift_a_difference() -> None:
    entry = one_run_each(1.2)
    assert entry["significant"] is True  # the requests alone see a 20% shift, and it is there
    assert entry["replicated"] is False
    assert entry["outcome"] == "inconclusive"
    assert entry["sentence"].startswith("orca-again raises p50 e2e by ")
    assert entry["sentence"].endswith(f"; {ONE_RUN_CAVEAT})")
    side_by_side = one_run_each(1.2, simultaneous=True)  # a live split: the load hit both
    assert side_by_side["outcome"] == "difference"
    assert ONE_RUN_CAVEAT not in side_by_side["sentence"]


def test_one_run_per_arm_does_not_call_an_equivalence_either() -> None:
    entry = one_run_each(1.0, n=20000)
    assert entry["equivalent"] is True and entry["outcome"] == "inconclusive"
    assert entry["sentence"].startswith("no difference in p50 e2e larger than 5%")
    assert entry["sentence"].endswith(f"; {ONE_RUN_CAVEAT})")


def drifting(rng: np.random.Generator, workload: np.ndarray, num_runs: int) -> list[RunSample]:
    """Runs of one workload whose whole level moves from run to run by 20% (sd)."""
    n = workload.size
    levels = rng.lognormal(0, 0.2, num_runs)
    return [sample(workload * rng.lognormal(0, 0.2, n) * level) for level in levels]


def test_repeats_tell_a_run_level_shift_from_a_policy() -> None:
    workload = draw(500, 12)
    same = differs = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        a, b = drifting(rng, workload, 3), drifting(rng, workload * 5, 3)
        aa = compare_runs(
            "orca", a, "orca-again", drifting(rng, workload, 3), slo_active=False, rng=rng,
            num_resamples=500, metrics=E2E,
        )[0]  # fmt: skip
        ab = compare_runs(
            "static", b, "orca", a, slo_active=False, rng=rng, num_resamples=500, metrics=E2E
        )[0]
        same += aa["outcome"] == "difference"
        differs += ab["outcome"] == "difference"
    assert same <= 1  # at most a false alarm in 20 (5% expected)
    assert differs >= 19  # a 5x effect stands out of a 20% drift in 3 runs each
