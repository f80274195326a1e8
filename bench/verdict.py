"""The verdict: each arm against the baseline, per metric, with a 95% bootstrap interval.

Metrics (`METRICS`): TTFT p50 and p99, TPOT p50, ITL p99, e2e p50 and p99, output tok/s and
goodput, here the *share* of requests meeting every SLO (a failed request misses them).

`diff` is relative, arm / baseline - 1 (-0.38: the arm's value is 38% lower), and `diff_abs`
is arm - baseline in the metric's unit; `ci95` and `ci95_abs` are their bootstrap intervals
(bench/stats.py `interval`: percentiles, or Student's t over fewer than 10 runs).
`significant` is whether `ci95` excludes 0 (`ci95_abs` when the relative one is undefined, as
for a goodput share of 0), and None when there is no interval at all (throughput from a single
run: a run's duration is one number, so only `--repeats` can tell how much it varies).

Equivalence (two one-sided tests, TOST, at the same alpha = 0.05): the arms are `equivalent`
when the 90% interval of the relative difference lies inside (-margin, +margin), the margin
from `--equivalence-margin` (default 5%). `outcome` is then "equivalent" (no difference
larger than the margin, even where a smaller one is significant), "difference" (significant
and not equivalent) or "inconclusive" (neither).

Replication: arms run one after the other (the bench) with one run each confound the arm with
the run: load shared by a whole run (a noisy neighbour, a throttled CPU) shifts every request
of it, and no resample of its requests can see that. Such a verdict is not `replicated`: its
`outcome` is "inconclusive" whatever the requests say, and a sentence that would have named a
difference or an equivalence says so (`ONE_RUN_CAVEAT`). Two runs per arm or more, or arms
that served side by side (a live split, `simultaneous`), are replicated.

Resampling (bench/stats.py): over requests, or over runs and then requests with several runs.
When both arms ran the same workload (the bench, a replay) the resamples are paired: one draw of
request indices is applied to both arms, so a long prompt drawn twice weighs twice in each, and
the workload's own spread cancels out of the difference. Arms that served different requests
(a live split) are resampled independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bench.client import RequestResult
from bench.metrics import Slo, meets_slo, tpot
from bench.stats import (
    cluster_weights,
    interval,
    resample_weights,
    weighted_mean,
    weighted_quantile,
)

Kind = Literal["quantile", "throughput", "share"]
DEFAULT_RESAMPLES = 2000
#: relative margin of the equivalence test: differences inside +-5% count as none
DEFAULT_EQUIVALENCE_MARGIN = 0.05
#: below this many samples beyond a quantile, its interval is flagged as rough
MIN_TAIL_SAMPLES = 10
#: appended to a one-run verdict's sentence that the requests alone would have decided
ONE_RUN_CAVEAT = "one run per arm: run-to-run variation unmeasured; use --repeats 3"


@dataclass(frozen=True)
class MetricSpec:
    """One compared metric: where its samples come from and which way is better."""

    key: str
    label: str
    unit: str
    kind: Kind
    field: str = ""  # RunSample attribute of the samples
    q: float = 0.5
    higher_is_better: bool = False


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ttft_p50", "p50 TTFT", "ms", "quantile", "ttft_ms", 0.50),
    MetricSpec("ttft_p99", "p99 TTFT", "ms", "quantile", "ttft_ms", 0.99),
    MetricSpec("tpot_p50", "p50 TPOT", "ms", "quantile", "tpot_ms", 0.50),
    MetricSpec("itl_p99", "p99 ITL", "ms", "quantile", "itl_ms", 0.99),
    MetricSpec("e2e_p50", "p50 e2e", "ms", "quantile", "e2e_ms", 0.50),
    MetricSpec("e2e_p99", "p99 e2e", "ms", "quantile", "e2e_ms", 0.99),
    MetricSpec("output_throughput", "output tok/s", "tok/s", "throughput", higher_is_better=True),
    MetricSpec("goodput", "goodput", "share", "share", "good", higher_is_better=True),
)
METRICS_BY_KEY = {m.key: m for m in METRICS}


@dataclass(frozen=True)
class RunSample:
    """One run of one arm, indexed by the workload's request index (NaN: not measured)."""

    ttft_ms: np.ndarray  # (n,)
    tpot_ms: np.ndarray  # (n,)
    e2e_ms: np.ndarray  # (n,)
    output_tokens: np.ndarray  # (n,) 0 unless completed
    good: np.ndarray  # (n,) 1 met every SLO, 0 missed one or failed, NaN not sent/cancelled
    itl_ms: np.ndarray  # (G,) every inter-token gap of the run
    itl_request: np.ndarray  # (G,) the request index of each gap
    duration_s: float | None

    @property
    def size(self) -> int:
        return int(self.ttft_ms.size)


def run_sample(
    results: Sequence[RequestResult], num_requests: int, duration_s: float | None, slo: Slo
) -> RunSample:
    """A run's per-request arrays; requests never sent or cancelled stay NaN."""
    ttft, per_token, e2e, good = (np.full(num_requests, np.nan) for _ in range(4))
    tokens = np.zeros(num_requests)
    gaps: list[float] = []
    gap_request: list[int] = []
    for r in results:
        i = r.index
        if r.error is not None:
            good[i] = 0.0
        if not r.success:
            continue
        good[i] = float(meets_slo(r, slo))
        tokens[i] = r.output_tokens
        if r.ttft is not None:
            ttft[i] = r.ttft * 1000
        if (t := tpot(r)) is not None:
            per_token[i] = t * 1000
        if r.latency is not None:
            e2e[i] = r.latency * 1000
        gaps += [g * 1000 for g in r.itl]
        gap_request += [i] * len(r.itl)
    return RunSample(
        ttft,
        per_token,
        e2e,
        tokens,
        good,
        np.asarray(gaps),
        np.asarray(gap_request, int),
        duration_s,
    )


@dataclass(frozen=True)
class Estimate:
    """A metric of one arm: its value, its bootstrap replicates (None: no interval), n."""

    value: float | None
    replicates: np.ndarray | None
    n: int


def estimate(
    spec: MetricSpec, runs: Sequence[RunSample], weights: Sequence[np.ndarray]
) -> Estimate:
    """The metric over all runs pooled, and its replicates under `weights` (one block per run)."""
    ones = [np.ones((1, run.size), dtype=np.int64) for run in runs]
    value = _statistic(spec, runs, ones)
    point = None if value is None or not np.isfinite(value[0]) else float(value[0])
    replicates = _statistic(spec, runs, weights)
    return Estimate(point, replicates, _count(spec, runs))


def _statistic(
    spec: MetricSpec, runs: Sequence[RunSample], weights: Sequence[np.ndarray]
) -> np.ndarray | None:
    w = np.concatenate(list(weights), axis=1)
    if spec.kind == "throughput":
        if any(run.duration_s is None for run in runs) or (w.shape[0] > 1 and len(runs) < 2):
            return None  # one run: its duration does not vary under a resample of requests
        tokens = np.concatenate([run.output_tokens for run in runs])
        # block r of a row sums to c_r * n_r: c_r is how often run r was drawn
        run_counts = np.stack([b.sum(axis=1) / max(b.shape[1], 1) for b in weights], axis=1)
        durations = np.asarray([run.duration_s for run in runs], dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (w @ tokens) / (run_counts @ durations)
    if spec.kind == "share":
        return weighted_mean(np.concatenate([getattr(run, spec.field) for run in runs]), w)
    if spec.field == "itl_ms":
        offsets = np.cumsum([0] + [run.size for run in runs[:-1]])
        gaps = np.concatenate([run.itl_ms for run in runs])
        owner = np.concatenate(
            [run.itl_request + off for run, off in zip(runs, offsets, strict=True)]
        )
        return weighted_quantile(gaps, w, spec.q, columns=owner)
    values = np.concatenate([getattr(run, spec.field) for run in runs])
    return weighted_quantile(values, w, spec.q)


def _count(spec: MetricSpec, runs: Sequence[RunSample]) -> int:
    if spec.kind == "throughput":
        return len(runs)
    values = [run.itl_ms if spec.field == "itl_ms" else getattr(run, spec.field) for run in runs]
    return int(sum(np.isfinite(v).sum() for v in values))


def compare_runs(
    baseline: str,
    base_runs: Sequence[RunSample],
    arm: str,
    arm_runs: Sequence[RunSample],
    *,
    slo_active: bool,
    rng: np.random.Generator,
    num_resamples: int = DEFAULT_RESAMPLES,
    paired: bool = True,
    metrics: Sequence[MetricSpec] = METRICS,
    margin: float = DEFAULT_EQUIVALENCE_MARGIN,
    simultaneous: bool = False,
    clusters: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """One entry per metric (goodput only with an SLO): `arm` against `baseline`.

    `simultaneous`: the arms served their requests side by side (a live split), so whatever
    load a run shared hit both, and one run per arm is replicated enough (module docstring).
    `clusters`: (baseline's, arm's) unit of each request of one unpaired run per arm (the
    user a live split assigned by): the bootstrap resamples units, not requests.
    """
    if clusters is not None:
        return _compare_clustered(
            baseline, base_runs, arm, arm_runs, clusters, slo_active, rng, num_resamples,
            metrics, margin,
        )  # fmt: skip
    num = min(len(base_runs), len(arm_runs)) if paired else None
    base_runs, arm_runs = list(base_runs)[:num], list(arm_runs)[:num]
    base_sizes, arm_sizes = [r.size for r in base_runs], [r.size for r in arm_runs]
    if paired and base_sizes != arm_sizes:
        raise ValueError("paired runs need the same workload sizes")
    base_w = resample_weights(rng, base_sizes, num_resamples)
    arm_w = base_w if paired else resample_weights(rng, arm_sizes, num_resamples)
    method = _method(len(base_runs), len(arm_runs), paired, num_resamples)
    num_runs = min(len(base_runs), len(arm_runs))
    replicated = simultaneous or num_runs > 1
    entries = []
    for spec in metrics:
        if spec.kind == "share" and not slo_active:
            continue
        base = estimate(spec, base_runs, base_w)
        other = estimate(spec, arm_runs, arm_w)
        requests = min(sum(r.size for r in base_runs), sum(r.size for r in arm_runs))
        units = num_runs if num_runs > 1 else requests
        entry = compare_estimates(
            spec, baseline, base, arm, other, method, units, margin=margin, replicated=replicated
        )
        entries.append(entry)
    return entries


def _compare_clustered(
    baseline: str, base_runs: Sequence[RunSample], arm: str, arm_runs: Sequence[RunSample],
    clusters: tuple[np.ndarray, np.ndarray], slo_active: bool, rng: np.random.Generator,
    num_resamples: int, metrics: Sequence[MetricSpec], margin: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """`compare_runs` for one live run per arm, resampling each arm's units (users)."""
    base_w = [cluster_weights(rng, clusters[0], num_resamples)]
    arm_w = [cluster_weights(rng, clusters[1], num_resamples)]
    units = min(np.unique(clusters[0]).size, np.unique(clusters[1]).size)
    method = f"bootstrap over users (independent, {num_resamples} resamples)"
    entries = []
    for spec in metrics:
        if spec.kind == "share" and not slo_active:
            continue
        base, other = estimate(spec, base_runs, base_w), estimate(spec, arm_runs, arm_w)
        entries.append(
            compare_estimates(
                spec, baseline, base, arm, other, method, units, margin=margin, replicated=True
            )
        )
    return entries


def _method(base_runs: int, arm_runs: int, paired: bool, num_resamples: int) -> str:
    level = "runs, then requests" if max(base_runs, arm_runs) > 1 else "requests"
    pairing = "paired" if paired else "independent"
    return f"bootstrap over {level} ({pairing}, {num_resamples} resamples)"


def compare_estimates(
    spec: MetricSpec,
    baseline: str,
    base: Estimate,
    arm: str,
    other: Estimate,
    method: str,
    num_units: int | None = None,
    *,
    margin: float = DEFAULT_EQUIVALENCE_MARGIN,
    replicated: bool = True,
) -> dict[str, Any]:
    """The comparison entry of one metric from two arms' estimates (see the module docstring).

    `num_units`: what the outer resampling level drew (runs, or requests), for the interval.
    `margin`: the relative equivalence margin of the TOST.
    `replicated`: False for one run per arm, one after the other: no outcome but "inconclusive".
    """
    diff = diff_abs = None
    if base.value is not None and other.value is not None:
        diff_abs = other.value - base.value
        diff = other.value / base.value - 1 if base.value != 0 else None
    ci = ci_abs = ci90 = None
    if base.replicates is not None and other.replicates is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            relative = other.replicates / base.replicates - 1
            ci = interval(relative, diff, num_units=num_units, relative=True)
            ci_abs = interval(other.replicates - base.replicates, diff_abs, num_units=num_units)
            ci90 = interval(relative, diff, level=0.90, num_units=num_units, relative=True)
    decisive = ci if ci is not None and diff is not None else ci_abs
    significant = None if decisive is None else bool(decisive[0] > 0 or decisive[1] < 0)
    better = None
    if significant and diff_abs is not None:
        better = (diff_abs > 0) == spec.higher_is_better
    equivalent = _equivalent(ci90 if diff is not None else None, ci_abs, margin)
    entry: dict[str, Any] = {
        "metric": spec.key,
        "label": spec.label,
        "unit": spec.unit,
        "baseline": baseline,
        "arm": arm,
        "baseline_value": base.value,
        "arm_value": other.value,
        "diff": diff,
        "ci95": list(ci) if ci is not None else None,
        "diff_abs": diff_abs,
        "ci95_abs": list(ci_abs) if ci_abs is not None else None,
        "significant": significant,
        "better": better,
        "equivalence_margin": margin,
        "ci90": list(ci90) if ci90 is not None and diff is not None else None,
        "equivalent": equivalent,
        "replicated": replicated,
        "outcome": _outcome(significant, equivalent, replicated),
        "n_baseline": base.n,
        "n_arm": other.n,
        "method": method,
        "note": _note(spec, base, other),
    }
    entry["sentence"] = sentence(entry)
    return entry


def _equivalent(
    ci90: tuple[float, float] | None, ci_abs: tuple[float, float] | None, margin: float
) -> bool | None:
    """TOST: both one-sided tests reject a difference of +-margin (None: no interval at all)."""
    if ci90 is not None:
        return bool(-margin < ci90[0] and ci90[1] < margin)
    if ci_abs is not None:  # relative undefined (baseline 0): only an exact tie is equivalent
        return bool(ci_abs[0] == 0 == ci_abs[1])
    return None


def _outcome(significant: bool | None, equivalent: bool | None, replicated: bool) -> str | None:
    """Equivalence first: a difference whose whole 90% interval lies inside the margin (a
    significant 0.1% on two near-deterministic runs) is no difference worth naming. Without
    replication neither can be told from the runs' own shift: inconclusive."""
    if significant is None:
        return None
    if not replicated:
        return "inconclusive"
    if equivalent:
        return "equivalent"
    return "difference" if significant else "inconclusive"


def _note(spec: MetricSpec, base: Estimate, other: Estimate) -> str | None:
    if spec.kind == "throughput" and (base.replicates is None or other.replicates is None):
        return "one run per arm: no interval for a throughput; use --repeats 3 or more"
    if base.value is None or other.value is None:
        return "no samples in one of the arms"
    if spec.kind == "quantile" and min(base.n, other.n) * (1 - spec.q) < MIN_TAIL_SAMPLES:
        n = min(base.n, other.n)
        return (
            f"only {n} samples: fewer than {MIN_TAIL_SAMPLES} lie beyond the "
            f"p{spec.q * 100:g}, so its interval is rough"
        )
    return None


def _pct(x: float, digits: int) -> str:
    return f"{abs(x) * 100:.{digits}f}%"


def _digits(*xs: float) -> int:
    return 1 if min(abs(x) for x in xs) < 0.1 else 0


def sentence(entry: dict[str, Any]) -> str:
    """The plain sentence: "orca lowers p99 e2e by 38% (95% CI 31%-45%)" and its variants;
    one that names a difference or an equivalence from one run per arm ends in the caveat."""
    text = _sentence(entry)
    decided = entry["significant"] or entry.get("equivalent")
    if entry.get("replicated", True) or not decided or not text.endswith(")"):
        return text
    return f"{text[:-1]}; {ONE_RUN_CAVEAT})"


def _sentence(entry: dict[str, Any]) -> str:
    arm, label = entry["arm"], entry["label"]
    diff, ci, diff_abs = entry["diff"], entry["ci95"], entry["diff_abs"]
    if diff_abs is None:
        return f"no comparison of {label}: {entry['note'] or 'no samples'}"
    if entry["unit"] == "share":
        return _share_sentence(entry)
    if diff is None:
        return f"{arm} changes {label} by {diff_abs:+.3g} {entry['unit']} (the baseline is 0)"
    verb = "raises" if diff > 0 else "lowers"
    if entry["significant"] is None:
        return f"{arm} {verb} {label} by {_pct(diff, _digits(diff))} ({entry['note']})"
    if not entry["significant"] or entry.get("equivalent"):
        return _no_difference_sentence(entry)
    lo, hi = sorted(abs(x) for x in ci) if ci is not None else (None, None)
    if lo is None or hi is None:
        return f"{arm} {verb} {label} by {_pct(diff, _digits(diff))}"
    d = _digits(diff, lo, hi)
    return f"{arm} {verb} {label} by {_pct(diff, d)} (95% CI {_pct(lo, d)}-{_pct(hi, d)})"


def _no_difference_sentence(entry: dict[str, Any]) -> str:
    """Equivalent, inconclusive, or (entries without a TOST) plainly not significant."""
    arm, label, diff, ci = entry["arm"], entry["label"], entry["diff"], entry["ci95"]
    equivalent, margin = entry.get("equivalent"), entry.get("equivalence_margin")
    ci90 = entry.get("ci90")
    if equivalent and margin is not None and ci90 is not None:
        d = _digits(diff, *ci90)
        return (
            f"no difference in {label} larger than {margin * 100:g}% "
            f"({arm} {diff * 100:+.{d}f}%, 90% CI {ci90[0] * 100:+.{d}f}% to "
            f"{ci90[1] * 100:+.{d}f}%)"
        )
    if ci is None:
        return f"no significant difference in {label}"
    d = _digits(diff, *ci)
    body = f"{arm} {diff * 100:+.{d}f}%, 95% CI {ci[0] * 100:+.{d}f}% to {ci[1] * 100:+.{d}f}%"
    if equivalent is False and margin is not None:
        return (
            f"inconclusive on {label}: no significant difference, but one up to "
            f"{margin * 100:g}% is not ruled out ({body})"
        )
    return f"no significant difference in {label} ({body})"


def _share_sentence(entry: dict[str, Any]) -> str:
    arm, label = entry["arm"], entry["label"]
    base, value, ci = entry["baseline_value"], entry["arm_value"], entry["ci95_abs"]
    span = f"from {base:.0%} to {value:.0%} of requests"
    pp = entry["diff_abs"] * 100
    if ci is None:
        return f"{arm} changes {label} {span} ({pp:+.1f} pp, no interval)"
    interval = f"95% CI {ci[0] * 100:+.1f} to {ci[1] * 100:+.1f} pp"
    if not entry["significant"]:
        margin = entry.get("equivalence_margin")
        if entry.get("equivalent") and margin is not None:
            relative = f"larger than {margin * 100:g}% relative"
            return f"no difference in {label} {relative} ({span}, {interval})"
        if entry.get("equivalent") is False:
            return f"inconclusive on {label}: not significant, not ruled out ({span}, {interval})"
        return f"no significant difference in {label} ({span}, {interval})"
    verb = "raises" if pp > 0 else "lowers"
    return f"{arm} {verb} {label} {span} ({pp:+.1f} pp, {interval})"
