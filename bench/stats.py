"""Vectorised bootstrap machinery for the verdict: resample weights, weighted quantiles, intervals.

A bootstrap resample of requests is a vector of counts (how often each request was drawn), so
every statistic here takes a `(B, n)` weight matrix, one row per resample, and computes all B
replicates at once: no Python loop over resamples.

- One run per arm: each row is Multinomial(n, 1/n), the ordinary bootstrap over requests.
- Several runs (`--repeats`): a two-level (hierarchical) bootstrap. Each row first draws R runs
  with replacement (counts c_r ~ Multinomial(R, 1/R)), then, for each run drawn c_r times,
  c_r * n_r of its requests with replacement. Run-to-run drift (a noisy neighbour, a thermal
  throttle) widens the interval, as it should.
- Histograms (live `/metrics`): bucket counts are resampled as Multinomial(N, observed share),
  and quantiles are interpolated linearly inside a bucket, as Prometheus' histogram_quantile.

Intervals are *expanded* percentile intervals of the replicates (Hesterberg, "What teachers
should know about the bootstrap", 2015): the percentile interval at a level widened so that, for
a mean, it matches Student's t with `num_units - 1` degrees of freedom and the sqrt(n / (n - 1))
variance correction, where the units are what the outer level resamples (requests, or runs with
`--repeats`). With hundreds of requests this changes nothing visible.

Few runs (`interval`): below `MIN_PERCENTILE_UNITS` outer units the percentiles cannot be read
that far out, since no resample reaches past the most extreme run. With 3 runs whose paired
differences share a sign (one time in four under drift alone) the percentile interval excludes
0: on runs drifting by 20% (sd), 200 A/A pairs of 200 requests a run, it flagged 32% of them
at 2 runs, 20% at 3, 7.5% at 5 and 3.5% at 8. There the interval is the estimate +- Student's t
quantile times the replicates' standard deviation, with the same sqrt(n / (n - 1)) correction
(for a mean of runs, the paired t interval), made on log(ratio) for a relative difference: it
flagged 0%, 1.5%, 3% and 3% (tests/test_bench_equivalence.py checks 3 runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: with fewer outer units (runs) than this, `interval` is `t_interval`, not the percentiles
MIN_PERCENTILE_UNITS = 10
#: a weight-matrix block stays under this many cells (memory for pooled per-token gaps)
MAX_BLOCK_CELLS = 4_000_000
#: above this many values a quantile is searched block by block (`_blocked_quantile`)
DIRECT_MAX_VALUES = 20_000
NUM_BLOCKS = 256


def cluster_weights(
    rng: np.random.Generator, clusters: np.ndarray, num_resamples: int
) -> np.ndarray:
    """A `(num_resamples, n)` matrix of request weights from a bootstrap over clusters: each
    row draws the run's clusters (users) with replacement, and a request weighs as often as
    its cluster was drawn. Requests of one user move together, so the interval is as wide as
    the number of users, not of requests, allows."""
    ids, owner = np.unique(np.asarray(clusters), return_inverse=True)
    draws = rng.multinomial(ids.size, np.full(ids.size, 1.0 / ids.size), size=num_resamples)
    return draws[:, owner].astype(np.int64)  # (num_resamples, n)


def resample_weights(
    rng: np.random.Generator, run_sizes: Sequence[int], num_resamples: int
) -> list[np.ndarray]:
    """Per run, a `(num_resamples, n_r)` matrix of request counts (see the module docstring).

    With one run, every row sums to n; with R runs, run r's block in a row sums to c_r * n_r.
    """
    sizes = [int(n) for n in run_sizes]
    if len(sizes) == 1:
        return [_plain_counts(rng, sizes[0], num_resamples)]
    num_runs = len(sizes)
    run_counts = rng.multinomial(num_runs, np.full(num_runs, 1.0 / num_runs), size=num_resamples)
    blocks = []
    for r, n in enumerate(sizes):
        if n == 0:
            blocks.append(np.zeros((num_resamples, 0), dtype=np.int64))
            continue
        blocks.append(rng.multinomial(run_counts[:, r] * n, np.full(n, 1.0 / n)))
    return blocks


def _plain_counts(rng: np.random.Generator, n: int, num_resamples: int) -> np.ndarray:
    """Multinomial(n, 1/n) rows, drawn as index resamples and counted with one bincount."""
    if n == 0:
        return np.zeros((num_resamples, 0), dtype=np.int64)
    picks = rng.integers(0, n, size=(num_resamples, n)) + (np.arange(num_resamples) * n)[:, None]
    return np.bincount(picks.ravel(), minlength=num_resamples * n).reshape(num_resamples, n)


def weighted_quantile(
    values: np.ndarray, weights: np.ndarray, q: float, columns: np.ndarray | None = None
) -> np.ndarray:
    """The q-quantile of each row's weighted sample: `(B,)` from values `(m,)`, weights `(B, k)`.

    Value i weighs `weights[:, columns[i]]` (default: column i; the per-token gaps of one
    request share its column). Equal to `np.quantile(np.repeat(values, row), q)` (numpy's
    linear method) for integer weights, without building the repeated arrays. NaN values are
    left out; a row whose weights are all zero gives NaN.
    """
    values = np.asarray(values, dtype=float)
    cols = np.arange(values.size) if columns is None else np.asarray(columns, dtype=np.int64)
    keep = np.flatnonzero(~np.isnan(values))
    order = keep[np.argsort(values[keep], kind="stable")]
    sorted_values, sorted_cols = values[order], cols[order]
    num_rows = weights.shape[0]
    if sorted_values.size == 0:
        return np.full(num_rows, np.nan)
    if sorted_values.size > DIRECT_MAX_VALUES:
        return _blocked_quantile(sorted_values, sorted_cols, weights, q)
    out = np.empty(num_rows)
    block = max(1, MAX_BLOCK_CELLS // sorted_values.size)
    for start in range(0, num_rows, block):
        w = np.asarray(weights[start : start + block][:, sorted_cols], dtype=np.int64)
        out[start : start + block] = _sorted_weighted_quantile(sorted_values, w, q)
    return out


def _sorted_weighted_quantile(v: np.ndarray, w: np.ndarray, q: float) -> np.ndarray:
    rows, m = w.shape
    cum = np.cumsum(w, axis=1)  # (rows, m), integers
    total = cum[:, -1].copy()  # NOTE: a copy: `cum` is shifted in place below
    h = np.maximum(total - 1, 0) * q
    k = np.floor(h).astype(np.int64)
    frac = h - k
    # NOTE: the repeated sample's element j is v[#(cum <= j)]; one searchsorted over all rows,
    # each row's cumulative weights shifted past the previous row's.
    shift = np.arange(rows, dtype=np.int64) * (int(total.max()) + 2)
    cum += shift[:, None]
    flat = cum.ravel()
    base = np.arange(rows) * m
    lo = np.minimum(np.searchsorted(flat, k + shift, side="right") - base, m - 1)
    hi = np.minimum(np.searchsorted(flat, k + 1 + shift, side="right") - base, m - 1)
    result = v[lo] + frac * (v[hi] - v[lo])
    result[total <= 0] = np.nan
    return result


def _blocked_quantile(v: np.ndarray, cols: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """The direct path's answer for many values (per-token gaps): each block of the sorted
    values gets its total weight per row from one matrix product, and only the block that holds
    a row's rank is searched value by value."""
    m, k = v.size, weights.shape[1]
    num_blocks = min(NUM_BLOCKS, m)
    edges = np.linspace(0, m, num_blocks + 1).astype(np.int64)
    block_of = np.repeat(np.arange(num_blocks), np.diff(edges))
    counts = np.bincount(cols * num_blocks + block_of, minlength=k * num_blocks)
    # NOTE: in float64 (exact for these integer counts) so the product runs on BLAS
    per_block = weights.astype(np.float64) @ counts.reshape(k, num_blocks).astype(np.float64)
    cum_blocks = np.rint(np.cumsum(per_block, axis=1)).astype(np.int64)  # (rows, blocks)
    total = cum_blocks[:, -1]
    h = np.maximum(total - 1, 0) * q
    j = np.floor(h).astype(np.int64)
    frac = h - j
    lo = _position(cols, weights, edges, cum_blocks, j)
    hi = _position(cols, weights, edges, cum_blocks, np.minimum(j + 1, np.maximum(total - 1, 0)))
    result = v[lo] + frac * (v[hi] - v[lo])
    result[total <= 0] = np.nan
    return result


def _position(
    cols: np.ndarray, weights: np.ndarray, edges: np.ndarray, cum_blocks: np.ndarray, j: np.ndarray
) -> np.ndarray:
    """Per row, the sorted position of the repeated sample's element j."""
    num_blocks = edges.size - 1
    block = np.minimum((cum_blocks <= j[:, None]).sum(axis=1), num_blocks - 1)
    rows = np.arange(j.size)
    before = np.where(block > 0, cum_blocks[rows, np.maximum(block - 1, 0)], 0)
    local = j - before
    out = np.empty(j.size, dtype=np.int64)
    for b in np.unique(block):
        members = np.flatnonzero(block == b)
        start, end = edges[b], edges[b + 1]
        cum = np.cumsum(weights[members][:, cols[start:end]], axis=1)  # (members, block size)
        found = (cum <= local[members][:, None]).sum(axis=1)
        out[members] = start + np.minimum(found, end - start - 1)
    return out


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each row's weighted mean of `values` (NaN values left out); NaN for an all-zero row."""
    values = np.asarray(values, dtype=float)
    keep = ~np.isnan(values)
    w = weights[:, keep].astype(float)
    total = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (w @ values[keep]) / total, np.nan)


def expanded_tail(level: float, num_units: int | None) -> float:
    """The tail probability of each side of the expanded percentile interval (module docstring)."""
    tail = (1 - level) / 2
    if num_units is None or num_units < 2:
        return tail
    from scipy import stats  # NOTE: lazily: `carousel serve` builds this CLI too

    z = np.sqrt(num_units / (num_units - 1)) * stats.t.ppf(1 - tail, num_units - 1)
    return float(stats.norm.sf(z))


def percentile_interval(
    replicates: np.ndarray,
    level: float = 0.95,
    num_units: int | None = None,
    max_nan_share: float = 0.05,
) -> tuple[float, float] | None:
    """The expanded percentile interval of the replicates; None when too many are undefined.

    `num_units`: how many independent units the outer level resampled (None: no expansion).
    """
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0 or finite.size < (1 - max_nan_share) * replicates.size:
        return None
    tail = expanded_tail(level, num_units) * 100
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return float(lo), float(hi)


def t_interval(
    replicates: np.ndarray,
    point: float,
    level: float = 0.95,
    num_units: int = 2,
    max_nan_share: float = 0.05,
) -> tuple[float, float] | None:
    """`point` +- t(num_units - 1) * sqrt(num_units / (num_units - 1)) * sd(replicates)."""
    finite = replicates[np.isfinite(replicates)]
    if finite.size < 2 or finite.size < (1 - max_nan_share) * replicates.size or num_units < 2:
        return None
    from scipy import stats  # NOTE: lazily, as in `expanded_tail`

    quantile = stats.t.ppf(1 - (1 - level) / 2, num_units - 1)
    half = quantile * np.sqrt(num_units / (num_units - 1)) * float(np.std(finite, ddof=1))
    return point - half, point + half


def interval(
    replicates: np.ndarray,
    point: float | None,
    level: float = 0.95,
    num_units: int | None = None,
    relative: bool = False,
) -> tuple[float, float] | None:
    """The interval the verdict uses: `t_interval` over few units, else `percentile_interval`.

    `relative`: the replicates are ratios - 1; over few units the t interval is made for
    log(ratio) and mapped back, so it stays above -100% and a x2 weighs as much as a x0.5.
    """
    few = num_units is not None and 2 <= num_units < MIN_PERCENTILE_UNITS
    if not few or point is None or num_units is None:
        return percentile_interval(replicates, level, num_units)
    if not relative:
        return t_interval(replicates, point, level, num_units)
    if point <= -1:
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        logs = np.log1p(np.where(replicates > -1, replicates, np.nan))
    found = t_interval(logs, float(np.log1p(point)), level, num_units)
    return None if found is None else (float(np.expm1(found[0])), float(np.expm1(found[1])))


def histogram_quantile(upper_bounds: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Prometheus' histogram_quantile over the last axis of per-bucket (not cumulative) counts.

    `upper_bounds` are the buckets' `le` values, the last one +Inf. Inside a bucket the
    quantile is interpolated linearly from its lower bound (0 for the first bucket); a quantile
    that falls in the +Inf bucket is the largest finite bound. NaN where the count is zero.
    """
    counts = np.asarray(counts, dtype=float)
    bounds = np.asarray(upper_bounds, dtype=float)
    lower = np.concatenate([[0.0], bounds[:-1]])
    cum = np.cumsum(counts, axis=-1)
    total = cum[..., -1]
    rank = q * total
    index = np.minimum((cum < rank[..., None]).sum(axis=-1), bounds.size - 1)
    below = np.where(
        index > 0, np.take_along_axis(cum, np.maximum(index - 1, 0)[..., None], -1)[..., 0], 0.0
    )
    in_bucket = np.take_along_axis(counts, index[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(in_bucket > 0, (rank - below) / in_bucket, 0.0)
    lo, hi = lower[index], bounds[index]
    finite_top = bounds[np.isfinite(bounds)].max() if np.isfinite(bounds).any() else np.nan
    value = np.where(np.isinf(hi), finite_top, lo + (hi - lo) * frac)
    return np.where(total > 0, value, np.nan)


def resample_histogram(
    rng: np.random.Generator, counts: np.ndarray, num_resamples: int
) -> np.ndarray:
    """`(num_resamples, K)` bucket counts drawn as Multinomial(N, counts / N)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros((num_resamples, counts.size), dtype=np.int64)
    return rng.multinomial(total, counts / total, size=num_resamples)


def histogram_share_below(upper_bounds: np.ndarray, counts: np.ndarray, x: float) -> np.ndarray:
    """The share of observations <= x over the last axis, linear inside x's bucket.

    Nothing of the +Inf bucket counts as below x. NaN where the count is zero.
    """
    counts = np.asarray(counts, dtype=float)
    bounds = np.asarray(upper_bounds, dtype=float)
    lower = np.concatenate([[0.0], bounds[:-1]])
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(np.isinf(bounds), 0.0, np.clip((x - lower) / (bounds - lower), 0.0, 1.0))
    total = counts.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (counts @ frac) / total, np.nan)
