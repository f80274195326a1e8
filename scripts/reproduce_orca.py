"""Reproduce the Orca paper's end-to-end experiment on the sim and print it beside the paper.

    python scripts/reproduce_orca.py            # ~2 minutes on one core
    python scripts/reproduce_orca.py --requests 100   # a rougher, faster version

The curves are the paper's figure 10: FasterTransformer as ft(max_bs, mbs) = (1, 1) and
(8, 8), Orca as orca(max_bs) = 8, 16, 32. See docs/simulator.md for the setup, its sources,
the table and every gap.
"""

from __future__ import annotations

import argparse

from backends.sim_orca import (
    FT_CONFIGS,
    FT_ENGINE_SLOWDOWN_175B,
    LATENCY_TARGET_S,
    ORCA_MAX_BATCH_SIZES,
    PAPER,
    SETUPS,
    Point,
    sweep,
    throughput_at,
)

STATIC_RATES = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0]
ORCA_RATES = [1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0]

Row = tuple[str, float | None, float | None]


def _curve(points: list[Point]) -> str:
    return "  ".join(
        f"{p.throughput_rps:.3g}@{p.normalized_latency_s * 1000:.0f}ms" for p in points
    )


def _ft_175b(
    n: int, factor: float, align: bool, curves: bool
) -> dict[tuple[int, int], float | None]:
    """Each FT curve's throughput at the latency line on 175B, FT's steps `factor` as long."""
    at: dict[tuple[int, int], float | None] = {}
    for bs, mbs in FT_CONFIGS:
        points = sweep(SETUPS["175b"], "static", STATIC_RATES, n, bs, mbs, align, factor)
        at[bs, mbs] = throughput_at(points)
        if curves:
            print(f"  175B ft({bs},{mbs}) x{factor}: {_curve(points)}")
    return at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per rate")
    parser.add_argument("--curves", action="store_true", help="print every point of a sweep")
    parser.add_argument(
        "--ft-slowdown", type=float, default=FT_ENGINE_SLOWDOWN_175B,
        help="FT's step time over the sim's on 175B for the extra rows (the paper: up to 1.47)",
    )  # fmt: skip
    parser.add_argument(
        "--no-align-prompts", dest="align", action="store_false",
        help="FT prefills each member's whole prompt (not as the paper describes FT)",
    )  # fmt: skip
    args = parser.parse_args()
    n, target = args.requests, f"{LATENCY_TARGET_S * 1000:.0f} ms"
    paper_ft, paper_orca = PAPER["175b", "static", "at_190ms"], PAPER["175b", "orca", "at_190ms"]
    rows: list[Row] = []
    ft = _ft_175b(n, 1.0, args.align, args.curves)
    for (bs, mbs), value in ft.items():
        rows.append((f"175B ft({bs},{mbs}): req/s at {target}", value, paper_ft))
    orca: dict[int, float | None] = {}
    for bs in ORCA_MAX_BATCH_SIZES:
        points = sweep(SETUPS["175b"], "orca", ORCA_RATES, n, bs)
        orca[bs] = value = throughput_at(points)
        rows.append((f"175B orca({bs}): req/s at {target}", value, paper_orca))
        if args.curves:
            print(f"  175B orca({bs}): {_curve(points)}")
    for bs, mbs in FT_CONFIGS:
        points = sweep(SETUPS["101b"], "static", STATIC_RATES, n, bs, mbs, args.align)
        peak = max(p.throughput_rps for p in points)
        rows.append((f"101B ft({bs},{mbs}): peak req/s", peak, PAPER["101b", "static", "peak"]))
        if args.curves:
            print(f"  101B ft({bs},{mbs}): {_curve(points)}")
    slow = _ft_175b(n, args.ft_slowdown, args.align, args.curves)
    for (bs, mbs), value in slow.items():
        label = f"175B ft({bs},{mbs}), FT {args.ft_slowdown}x slower: at {target}"
        rows.append((label, value, paper_ft))
    print(f"{'figure':58} {'sim':>8} {'paper':>8} {'sim/paper':>9}")
    for label, sim, paper in rows:
        ratio = f"{sim / paper:.2f}" if sim is not None and paper else "-"
        shown = f"{sim:.3g}" if sim is not None else "-"
        print(f"{label:58} {shown:>8} {paper:>8.3g} {ratio:>9}")
    best_orca = max((v for v in orca.values() if v), default=None)
    for name, fts in (("FT", ft), (f"FT {args.ft_slowdown}x slower", slow)):
        best_ft = max((v for v in fts.values() if v), default=None)
        if best_ft and best_orca:
            print(f"ratio at {target}: best orca / best {name} = {best_orca / best_ft:.1f}x "
                  f"(paper {paper_orca / paper_ft:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
