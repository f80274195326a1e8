"""The mean of a per-request metric of one bench arm against another, with a paired
bootstrap 95% interval (the bench's verdict gives quantiles; schedulers' targets are means).

    python scripts/bench_mean_ci.py RESULTS/requests.jsonl orca sjf [--field ttft_s]
        [--user NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    keys = sorted(set(base) & set(other))
    b = np.array([base[k] for k in keys])
    a = np.array([other[k] for k in keys])
    finite = np.isfinite(a) & np.isfinite(b)
    b, a = b[finite], a[finite]
    rng = np.random.default_rng(0)
    draws = rng.integers(0, b.size, size=(args.resamples, b.size))  # (R, n) paired draws
    ratios = a[draws].mean(axis=1) / b[draws].mean(axis=1) - 1
    low, high = np.percentile(ratios, [2.5, 97.5])
    print(
        f"{args.arm} against {args.baseline}: mean {args.field} {b.mean() * 1000:.0f} -> "
        f"{a.mean() * 1000:.0f} ms ({a.mean() / b.mean() - 1:+.1%}, 95% CI {low:+.1%} to "
        f"{high:+.1%}; n = {b.size} paired requests)"
    )


if __name__ == "__main__":
    main()
