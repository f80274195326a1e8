"""Reproduce the Orca paper's end-to-end experiment on the sim and print it beside the paper.

    python scripts/reproduce_orca.py            # ~1-2 minutes on one core
    python scripts/reproduce_orca.py --requests 100   # a rougher, faster version

See docs/simulator.md for the table, the cost model and every gap.
"""

from __future__ import annotations

import argparse

from backends.sim_orca import LATENCY_TARGET_S, PAPER, SETUPS, Point, sweep, throughput_at

STATIC_RATES = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0]
ORCA_RATES = [1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0]


def _curve(points: list[Point]) -> str:
    return "  ".join(
        f"{p.throughput_rps:.3g}@{p.normalized_latency_s * 1000:.0f}ms" for p in points
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per rate")
    parser.add_argument("--curves", action="store_true", help="print every point of a sweep")
    args = parser.parse_args()
    n = args.requests
    target = f"{LATENCY_TARGET_S * 1000:.0f} ms"
    rows: list[tuple[str, float | None, float | None]] = []
    at: dict[tuple[str, int], float | None] = {}
    for policy, sizes, rates in (("static", (1, 8), STATIC_RATES), ("orca", (8, 16), ORCA_RATES)):
        for size in sizes:
            points = sweep(SETUPS["175b"], policy, rates, n, max_batch_size=size)
            at[policy, size] = value = throughput_at(points)
            paper = PAPER["175b", policy, "at_190ms"]
            rows.append((f"175B PP2xTP8 {policy} max_bs={size}: req/s at {target}", value, paper))
            if args.curves:
                print(f"  {policy} max_bs={size}: {_curve(points)}")
    for size in (1, 8):
        points = sweep(SETUPS["101b"], "static", STATIC_RATES, n, max_batch_size=size)
        peak = max(p.throughput_rps for p in points)
        rows.append(
            (f"101B TP8 static max_bs={size}: peak req/s", peak, PAPER["101b", "static", "peak"])
        )
        if args.curves:
            print(f"  101B static max_bs={size}: {_curve(points)}")
    print(f"{'figure':58} {'sim':>8} {'paper':>8} {'sim/paper':>9}")
    for label, sim, paper in rows:
        ratio = f"{sim / paper:.2f}" if sim is not None and paper else "-"
        shown = f"{sim:.3g}" if sim is not None else "-"
        print(f"{label:58} {shown:>8} {paper:>8.3g} {ratio:>9}")
    for ft, orca in ((1, 8), (1, 16), (8, 16)):
        a, b = at["static", ft], at["orca", orca]
        if a and b:
            print(f"ratio at {target}: orca max_bs={orca} / static max_bs={ft} = {b / a:.1f}x "
                  f"(paper 36.9x)")  # fmt: skip


if __name__ == "__main__":
    main()
