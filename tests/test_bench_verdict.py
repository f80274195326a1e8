"""The verdict's statistics on synthetic data with known answers.

A real shift is found and its interval covers the true size; two arms drawn from one
distribution give "no significant difference" in at least 90 of 100 seeds, per metric; with
repeated runs that drift, only the two-level bootstrap keeps that promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from bench import stats
from bench.client import RequestResult
from bench.metrics import Slo
from bench.stats import (
    histogram_quantile,
    resample_histogram,
    resample_weights,
    weighted_mean,
    weighted_quantile,
)
from bench.verdict import METRICS_BY_KEY, RunSample, compare_runs, run_sample, sentence

B = 400  # resamples: modest, the tests run many seeds
GAPS = 6  # inter-token gaps per request


def test_weighted_quantile_equals_numpy_on_the_repeated_sample() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(size=60)
    values[[3, 17]] = np.nan  # left out
    weights = resample_weights(rng, [60], 25)[0]
    kept = ~np.isnan(values)
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        expected = [np.quantile(np.repeat(values[kept], row[kept]), q) for row in weights]
        np.testing.assert_allclose(weighted_quantile(values, weights, q), expected)
    np.testing.assert_allclose(
        weighted_mean(values, weights),
        [np.repeat(values[kept], row[kept]).mean() for row in weights],
    )


def test_many_values_are_searched_block_by_block_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    gaps = np.round(rng.lognormal(0, 1, 150 * 80), 1)  # ties, and per-request columns
    gaps[[5, 500]] = np.nan
    owner = np.repeat(np.arange(150), 80)
    weights = resample_weights(rng, [150], 60)[0]
    weights[:3] = 0  # rows with nothing drawn
    for q in (0.0, 0.5, 0.99, 1.0):
        monkeypatch.setattr(stats, "DIRECT_MAX_VALUES", 10**9)
        direct = weighted_quantile(gaps, weights, q, columns=owner)
        monkeypatch.setattr(stats, "DIRECT_MAX_VALUES", 100)
        blocked = weighted_quantile(gaps, weights, q, columns=owner)
        np.testing.assert_array_equal(direct, blocked)
        assert np.isnan(direct[:3]).all() and not np.isnan(direct[3:]).any()
    kept = ~np.isnan(gaps)
    row = weights[7][owner][kept]
    assert direct[7] == np.quantile(np.repeat(gaps[kept], row), 1.0)


def test_one_run_rows_draw_n_requests_and_runs_are_drawn_whole() -> None:
    rng = np.random.default_rng(1)
    (plain,) = resample_weights(rng, [50], 300)
    assert plain.shape == (300, 50) and (plain.sum(axis=1) == 50).all()
    assert abs(plain.mean() - 1) < 0.02 and abs(plain.var() - 1) < 0.1  # Multinomial(n, 1/n)
    blocks = resample_weights(rng, [10, 20, 30], 500)
    counts = np.stack([b.sum(axis=1) / n for b, n in zip(blocks, (10, 20, 30), strict=True)], 1)
    assert np.allclose(counts, np.round(counts)) and (counts.sum(axis=1) == 3).all()
    assert (counts == 0).any()  # some resamples leave a whole run out


def test_histogram_quantile_follows_prometheus() -> None:
    bounds = np.array([1.0, 2.0, 4.0, np.inf])
    counts = np.array([10, 30, 60, 0])  # cumulative 10, 40, 100
    assert histogram_quantile(bounds, counts, 0.05) == pytest.approx(0.5)  # from 0 up to 1
    assert histogram_quantile(bounds, counts, 0.25) == pytest.approx(1.5)
    assert histogram_quantile(bounds, counts, 0.7) == pytest.approx(3.0)
    tail = np.array([10, 30, 50, 10])
    assert histogram_quantile(bounds, tail, 0.99) == pytest.approx(4.0)  # +Inf: largest bound
    assert np.isnan(histogram_quantile(bounds, np.zeros(4), 0.5))
    draws = resample_histogram(np.random.default_rng(2), counts, 200)
    assert draws.shape == (200, 4) and (draws.sum(axis=1) == 100).all() and (draws[:, 3] == 0).all()


@dataclass(frozen=True)
class Workload:
    """What the bench fixes before a run: per request, a prompt cost and an output length."""

    prefill_ms: np.ndarray
    tokens: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, n: int, gaps: int = GAPS) -> Workload:
        return cls(rng.lognormal(np.log(200), 0.5, n), rng.integers(gaps + 1, 64, n).astype(float))


def sample(
    rng: np.random.Generator, n: int, scale: float = 1.0, workload: Workload | None = None
) -> RunSample:
    """A run of `n` requests: TTFT ~ prefill cost * noise, everything slower by `scale`."""
    w = workload or Workload.draw(rng, n)
    ttft = w.prefill_ms * scale * rng.lognormal(0, 0.05, n)
    tpot = rng.lognormal(np.log(30), 0.3, n) * scale
    itl = rng.lognormal(np.log(30), 0.4, n * GAPS) * scale
    return RunSample(
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=ttft + tpot * (w.tokens - 1),
        output_tokens=w.tokens,
        good=(ttft < 300).astype(float),
        itl_ms=itl,
        itl_request=np.repeat(np.arange(n), GAPS),
        duration_s=float(n / 4 * scale),
    )


def by_metric(entries: list[dict]) -> dict[str, dict]:
    return {e["metric"]: e for e in entries}


def test_a_real_ten_percent_ttft_shift_is_significant_and_its_interval_covers_it() -> None:
    found = covered = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        workload = Workload.draw(rng, 300)  # one workload, replayed to both arms
        base, slower = sample(rng, 300, 1.0, workload), sample(rng, 300, 1.1, workload)
        entries = by_metric(
            compare_runs("a", [base], "b", [slower], slo_active=True, rng=rng, num_resamples=B)
        )
        e = entries["ttft_p50"]
        found += e["significant"] is True and e["better"] is False
        covered += e["ci95"][0] <= 0.10 <= e["ci95"][1]
    assert found == 20
    assert covered >= 17  # a 95% interval: most seeds, not necessarily all 20


def test_a_shift_is_found_without_pairing_too_given_enough_requests() -> None:
    rng = np.random.default_rng(7)
    base, slower = sample(rng, 3000), sample(rng, 3000, 1.1)
    entries = compare_runs(
        "a", [base], "b", [slower], slo_active=False, rng=rng, num_resamples=B, paired=False
    )
    e = by_metric(entries)["ttft_p50"]
    assert e["significant"] is True and 0.0 < e["ci95"][0] < 0.1 < e["ci95"][1] < 0.2
    assert e["sentence"].startswith("b raises p50 TTFT by ") and "95% CI" in e["sentence"]
    assert "goodput" not in by_metric(entries)  # no SLO given


def test_one_distribution_gives_no_significant_difference_in_90_of_100_seeds() -> None:
    keys = ["ttft_p50", "ttft_p99", "tpot_p50", "itl_p99", "e2e_p50", "e2e_p99", "goodput"]
    quiet = dict.fromkeys(keys, 0)
    for seed in range(100):
        rng = np.random.default_rng(1000 + seed)
        entries = by_metric(
            compare_runs(
                "a",
                [sample(rng, 400)],
                "b",
                [sample(rng, 400)],
                slo_active=True,
                rng=rng,
                num_resamples=B,
            )
        )
        for key in keys:
            quiet[key] += entries[key]["significant"] is False
        assert entries["output_throughput"]["significant"] is None  # one run: no interval
    assert all(n >= 90 for n in quiet.values()), quiet


def drifting_runs(
    rng: np.random.Generator, num_runs: int, n: int, scale: float = 1.0
) -> list[RunSample]:
    """Runs whose whole level drifts from run to run (sd 15%), as on a shared, noisy host."""
    return [sample(rng, n, scale * float(rng.lognormal(0, 0.15))) for _ in range(num_runs)]


def test_repeats_use_a_two_level_bootstrap_that_sees_run_to_run_drift() -> None:
    hierarchical = flat = 0
    some = {"metrics": [METRICS_BY_KEY["e2e_p50"], METRICS_BY_KEY["output_throughput"]]}
    for seed in range(100):
        rng = np.random.default_rng(5000 + seed)
        a, b = drifting_runs(rng, 5, 100), drifting_runs(rng, 5, 100)
        e = by_metric(
            compare_runs("a", a, "b", b, slo_active=False, rng=rng, num_resamples=B, **some)
        )
        hierarchical += e["e2e_p50"]["significant"] is False
        assert e["output_throughput"]["ci95"] is not None  # several runs: an interval
        # the same runs glued into one, resampled over requests only, ignores the drift
        glued = [_glue(a)], [_glue(b)]
        g = by_metric(
            compare_runs(
                "a", glued[0], "b", glued[1], slo_active=False, rng=rng, num_resamples=B, **some
            )
        )
        flat += g["e2e_p50"]["significant"] is False
    assert hierarchical >= 90
    assert flat < 75  # why the second level is needed


def _glue(runs: list[RunSample]) -> RunSample:
    fields = ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens", "good", "itl_ms")
    offsets = np.cumsum([0] + [r.size for r in runs[:-1]])
    return RunSample(
        *(np.concatenate([getattr(r, f) for r in runs]) for f in fields),
        itl_request=np.concatenate([r.itl_request + o for r, o in zip(runs, offsets, strict=True)]),
        duration_s=sum(r.duration_s or 0 for r in runs),
    )


def test_a_throughput_gain_across_repeats_is_found() -> None:
    rng = np.random.default_rng(11)
    workloads = [Workload.draw(rng, 100) for _ in range(5)]  # repeat r: seed + r, both arms
    a = [sample(rng, 100, float(rng.lognormal(0, 0.05)), w) for w in workloads]
    b = [sample(rng, 100, 0.8 * float(rng.lognormal(0, 0.05)), w) for w in workloads]
    e = by_metric(compare_runs("static", a, "orca", b, slo_active=False, rng=rng, num_resamples=B))
    tput = e["output_throughput"]
    assert tput["significant"] is True and tput["better"] is True and tput["diff"] > 0.1
    assert tput["sentence"].startswith("orca raises output tok/s by ")


def test_run_sample_reads_request_results() -> None:
    ok = RequestResult(
        0, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4, usage_output_tokens=5, success=True
    )
    slow = RequestResult(1, 5, ttft=0.9, latency=1.3, usage_output_tokens=5, success=True)
    failed = RequestResult(2, 5, error="HTTP 500: boom")
    run = run_sample([ok, slow, failed], 4, 2.0, Slo(ttft_ms=500))
    np.testing.assert_allclose(run.ttft_ms[:2], [100, 900])
    np.testing.assert_allclose(run.tpot_ms[:2], [100, 100])
    assert np.isnan(run.ttft_ms[2:]).all()
    np.testing.assert_array_equal(run.good, [1, 0, 0, np.nan])  # failed misses; unsent is out
    assert run.itl_request.tolist() == [0] * 4 and run.output_tokens.tolist() == [5, 5, 0, 0]


def entry(**overrides: object) -> dict:
    base = {
        "metric": "e2e_p99", "label": "p99 e2e", "unit": "ms", "arm": "orca", "baseline": "static",
        "baseline_value": 1000.0, "arm_value": 620.0, "diff": -0.38, "ci95": [-0.45, -0.31],
        "diff_abs": -380.0, "ci95_abs": [-450.0, -310.0], "significant": True, "note": None,
    }  # fmt: skip
    return {**base, **overrides}


def test_sentences_read_plainly() -> None:
    assert sentence(entry()) == "orca lowers p99 e2e by 38% (95% CI 31%-45%)"
    assert (
        sentence(entry(significant=False, diff=-0.02, ci95=[-0.06, 0.03]))
        == "no significant difference in p99 e2e (orca -2.0%, 95% CI -6.0% to +3.0%)"
    )
    share = entry(
        metric="goodput", label="goodput", unit="share", baseline_value=0.81, arm_value=0.93,
        diff=0.148, diff_abs=0.12, ci95_abs=[0.08, 0.16],
    )  # fmt: skip
    assert sentence(share) == (
        "orca raises goodput from 81% to 93% of requests (+12.0 pp, 95% CI +8.0 to +16.0 pp)"
    )
    spec = METRICS_BY_KEY["output_throughput"]
    note = "one run per arm: no interval"
    tput = entry(label=spec.label, unit=spec.unit, diff=0.8, significant=None, note=note)
    assert sentence(tput) == f"orca raises output tok/s by 80% ({note})"


def test_the_few_runs_interval_of_a_mean_is_the_paired_t_interval() -> None:
    """Four runs, one value each: the bootstrap of their mean, read by `stats.interval`, gives
    Student's t interval of a mean, the textbook answer for four paired differences."""
    from scipy import stats as scipy_stats

    diffs = np.array([0.02, -0.05, 0.11, 0.04])
    rng = np.random.default_rng(0)
    weights = np.concatenate(resample_weights(rng, [1, 1, 1, 1], 20000), axis=1)
    replicates = weighted_mean(diffs, weights)
    found = stats.interval(replicates, float(diffs.mean()), num_units=4)
    assert found is not None
    low, high = found
    sem = scipy_stats.sem(diffs)
    want = scipy_stats.t.interval(0.95, 3, loc=diffs.mean(), scale=sem)
    assert abs(low - want[0]) < 0.03 * (want[1] - want[0])
    assert abs(high - want[1]) < 0.03 * (want[1] - want[0])
    assert want[0] < diffs.min()  # past the most extreme run, which no resample goes beyond:
    percentiles = stats.percentile_interval(replicates, num_units=4)
    assert percentiles is not None and percentiles[0] >= diffs.min()
