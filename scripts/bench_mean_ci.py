"""The mean of a per-request metric of one bench arm against another, with a paired
bootstrap 95% interval (the bench's verdict gives quantiles; schedulers' targets are means).

    python scripts/bench_mean_ci.py RESULTS/requests.jsonl orca sjf [--field ttft_s]
        [--user NAME]

The bootstrap is the verdict's (bench/stats.py): over requests, paired by request index, and
with `--repeats` over runs and then requests, with its interval for few runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.stats import interval, resample_weights, weighted_mean
from bench.verdict import ONE_RUN_CAVEAT


def per_request(
    rows: list[dict[str, object]], arm: str, field: str, user: str | None
) -> dict[tuple[int, int], float]:
    """(repeat, index) -> the field's value (NaN when the request failed)."""
    out: dict[tuple[int, int], float] = {}
    for row in rows:
        if row["arm"] != arm or (user is not None and row.get("user") != user):
            continue
        value = row.get(field)
        ok = row["success"] and isinstance(value, int | float)
        out[(int(row["repeat"]), int(row["index"]))] = float(value) if ok else np.nan  # type: ignore[arg-type]
    return out


def paired_runs(
    base: dict[tuple[int, int], float], other: dict[tuple[int, int], float]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per repeat, the (baseline, arm) values of the requests that succeeded in both arms."""
    runs = []
    for repeat in sorted({key[0] for key in base} & {key[0] for key in other}):
        keys = sorted(k for k in set(base) & set(other) if k[0] == repeat)
        b = np.array([base[k] for k in keys])
        a = np.array([other[k] for k in keys])
        finite = np.isfinite(a) & np.isfinite(b)
        if finite.any():
            runs.append((b[finite], a[finite]))
    return runs


def mean_difference(
    runs: list[tuple[np.ndarray, np.ndarray]], num_resamples: int, seed: int = 0
) -> tuple[float, tuple[float, float] | None]:
    """arm mean / baseline mean - 1 over all runs, and its 95% interval."""
    b = np.concatenate([run[0] for run in runs])
    a = np.concatenate([run[1] for run in runs])
    rng = np.random.default_rng(seed)
    weights = resample_weights(rng, [run[0].size for run in runs], num_resamples)
    w = np.concatenate(weights, axis=1)  # (B, n): the same draw for both arms (paired)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = weighted_mean(a, w) / weighted_mean(b, w) - 1
    units = len(runs) if len(runs) > 1 else b.size
    point = float(a.mean() / b.mean() - 1)
    return point, interval(ratios, point, num_units=units, relative=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("requests", type=Path)
    parser.add_argument("baseline")
    parser.add_argument("arm")
    parser.add_argument("--field", default="ttft_s")
    parser.add_argument("--user", default=None)
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.requests.read_text().splitlines() if line]
    base = per_request(rows, args.baseline, args.field, args.user)
    other = per_request(rows, args.arm, args.field, args.user)
    runs = paired_runs(base, other)
    if not runs:
        raise SystemExit(f"no request succeeded in both {args.baseline} and {args.arm}")
    point, ci = mean_difference(runs, args.resamples)
    b = np.concatenate([run[0] for run in runs])
    a = np.concatenate([run[1] for run in runs])
    span = "no interval" if ci is None else f"95% CI {ci[0]:+.1%} to {ci[1]:+.1%}"
    caveat = f"; {ONE_RUN_CAVEAT}" if len(runs) == 1 else ""
    print(
        f"{args.arm} against {args.baseline}: mean {args.field} {b.mean() * 1000:.0f} -> "
        f"{a.mean() * 1000:.0f} ms ({point:+.1%}, {span}; n = {b.size} paired requests "
        f"in {len(runs)} run(s){caveat})"
    )


if __name__ == "__main__":
    main()
