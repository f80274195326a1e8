"""The report's pictures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

- `latency_cdf*.png`: the CDF of TTFT and of end-to-end latency, one line per arm.
- `sweep.png`: request throughput (goodput dashed), output token throughput and p99 latency
  against the offered request rate, one line per arm (finite rates only).
- `carousel*.png`: the carousel picture, one panel per arm, x = engine iteration, y = batch
  seat; a coloured cell is a seat occupied by a request (one colour per request, a request keeps
  its seat), grey is an empty seat. Static batching shows a staircase of seats emptying until
  the whole batch is done; Orca refills a seat the iteration after it frees.
- `comparison*.png`: the verdict, one row per metric, each arm's ratio to the baseline (the
  first arm) on a log axis with its 95% interval; green better, red worse, grey no significant
  difference, a hollow marker where there is no interval, all said in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from bench.trace import ArmTrace, seat_grid

DPI = 110
EMPTY_SEAT = "#e4e4e4"


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(
    samples: dict[str, dict[str, list[float]]], path: Path, title: str = ""
) -> Path:
    """`samples[arm]` holds `ttft` and `e2e` latencies in seconds."""
    fig = _figure(11, 4.2)
    axes = fig.subplots(1, 2)
    for ax, key, name in zip(axes, ("ttft", "e2e"), ("TTFT", "End-to-end latency"), strict=True):
        for arm, values in samples.items():
            _cdf(ax, values.get(key, []), arm)
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(name)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_sweep(points: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """`points[arm]` is a list of {"rate", "metrics"} (metrics as in report.json)."""
    fig = _figure(15, 4.2)
    axes = fig.subplots(1, 3)
    for i, (arm, runs) in enumerate(points.items()):
        runs = sorted((r for r in runs if math.isfinite(r["rate"])), key=lambda r: r["rate"])
        if not runs:
            continue
        colour = f"C{i}"
        rates = [r["rate"] for r in runs]
        m = [r["metrics"] for r in runs]
        axes[0].plot(rates, [x["request_throughput"] for x in m], "o-", c=colour, label=arm)
        goodput = [x["goodput"] for x in m]
        if all(g is not None for g in goodput):
            axes[0].plot(rates, goodput, "s--", c=colour, label=f"{arm} goodput")
        axes[1].plot(rates, [x["output_throughput"] for x in m], "o-", c=colour, label=arm)
        e2e = [_s(x["e2e_latency_ms"]["p99"]) for x in m]
        ttft = [_s(x["ttft_ms"]["p99"]) for x in m]
        axes[2].plot(rates, e2e, "o-", c=colour, label=f"{arm} e2e")
        axes[2].plot(rates, ttft, "^--", c=colour, label=f"{arm} TTFT")
    labels = ("request throughput (req/s)", "output throughput (tok/s)", "p99 latency (s)")
    for ax, ylabel in zip(axes, labels, strict=True):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _s(ms: float | None) -> float:
    return float("nan") if ms is None else ms / 1000.0


_VERDICT_COLOURS = {True: "tab:green", False: "tab:red", None: "tab:gray"}
_LEGEND = (("tab:green", "o", "better (95% interval excludes 1)"),
           ("tab:red", "o", "worse (95% interval excludes 1)"),
           ("tab:gray", "o", "no significant difference"))  # fmt: skip


def plot_comparison(entries: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """`entries`: report.json `comparison` entries of one rate (several arms allowed)."""
    comparison_figure(entries, title).savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def comparison_figure(entries: list[dict[str, Any]], title: str = "") -> Figure:
    """The verdict's picture: x is the ratio arm / baseline on a log axis, so x0.5 and x2
    lie as far from 1 on either side and a +3000% p99 does not squash every other metric."""
    metrics = list(dict.fromkeys(_row_label(e) for e in entries))
    arms = list(dict.fromkeys(e["arm"] for e in entries))
    fig = _figure(8, 1.6 + 0.45 * len(metrics) * max(1, len(arms)) ** 0.5)
    ax = fig.subplots()
    step = 0.6 / max(1, len(arms))
    ratios: list[float] = []
    hollow = False
    for j, arm in enumerate(arms):
        offset = (j - (len(arms) - 1) / 2) * step
        for entry in (e for e in entries if e["arm"] == arm):
            if entry["diff"] is None or entry["diff"] <= -1:
                continue
            y = metrics.index(_row_label(entry)) + offset
            x = 1 + entry["diff"]
            colour = _VERDICT_COLOURS[entry["better"]]
            ci = entry["ci95"]
            ratios.append(x)
            if ci is None or ci[0] <= -1:
                ax.plot([x], [y], "o", mfc="none", c=colour)
                hollow = True
                continue
            lo, hi = 1 + ci[0], 1 + ci[1]
            ratios += [lo, hi]
            ax.errorbar([x], [y], xerr=[[x - lo], [hi - x]], fmt="o", c=colour, capsize=3)
            if len(arms) > 1:
                ax.annotate(arm, (hi, y), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize="small")  # fmt: skip
    ax.set_xscale("log")
    span = max([abs(math.log(r)) for r in ratios if r > 0] + [math.log(1.25)]) * 1.15
    ax.set_xlim(math.exp(-span), math.exp(span))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"x{v:.3g}"))
    ax.axvline(1, color="black", lw=0.8)
    ax.set_yticks(range(len(metrics)), metrics)
    ax.invert_yaxis()
    baseline = entries[0]["baseline"] if entries else ""
    who = arms[0] if len(arms) == 1 else "arm"
    ax.set_xlabel(f"{who} / {baseline} (log scale; 1 = the same as {baseline}), 95% interval")
    ax.grid(axis="x", alpha=0.3, which="both")
    handles = [Line2D([], [], color=c, marker=m, ls="none", label=t) for c, m, t in _LEGEND]
    if hollow:
        handles.append(Line2D([], [], color="tab:gray", marker="o", mfc="none", ls="none",
                              label="no interval (one run)"))  # fmt: skip
    below = -0.25 - 0.5 / max(1, len(metrics))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below), ncol=2,
              fontsize="small", frameon=False)  # fmt: skip
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def _row_label(entry: dict[str, Any]) -> str:
    return f"{entry['label']} (pp)" if entry["unit"] == "share" else entry["label"]


def plot_carousel(traces: dict[str, ArmTrace], path: Path, title: str = "") -> Path | None:
    """One panel per arm with a trace; returns None (draws nothing) when no arm has one."""
    fig = carousel_figure(traces, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=DPI)
    return path


def carousel_figure(traces: dict[str, ArmTrace], title: str = "") -> Figure | None:
    """The carousel picture (see `plot_carousel`), or None when no arm has a trace."""
    arms = {name: t for name, t in traces.items() if t.available}
    if not arms:
        return None
    grids = {name: seat_grid(t.iterations, t.max_num_seqs) for name, t in arms.items()}
    height = sum(max(1.6, 0.12 * g.cells.shape[0] + 1.0) for g in grids.values())
    fig = _figure(12, min(height, 40))
    axes = fig.subplots(len(grids), 1, squeeze=False, sharex=True)
    tab20 = matplotlib.colormaps["tab20"]
    # dark shades then light ones, so requests admitted one after the other differ in hue
    palette = [tab20(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    cmap = ListedColormap(palette).with_extremes(bad=EMPTY_SEAT)
    for ax, (name, grid) in zip(axes[:, 0], grids.items(), strict=True):
        cells = np.ma.masked_array(grid.cells % len(palette), mask=grid.cells < 0)
        ax.imshow(
            cells,
            aspect="auto",
            interpolation="nearest",
            origin="lower",
            cmap=cmap,
            vmin=0,
            vmax=len(palette) - 1,
        )
        limit = arms[name].max_num_seqs
        if limit is not None and limit < grid.cells.shape[0]:
            ax.axhline(limit - 0.5, color="black", lw=1, ls="--")
        ax.set_ylabel("seat")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(
            f"{name}: {grid.cells.shape[1]} iterations, {grid.num_requests} requests, "
            f"max_num_seqs={limit}, seats occupied {grid.occupancy:.0%}",
            fontsize="medium",
        )
    # imshow sets each panel's limits to its own image; show the longest run on every panel
    axes[-1, 0].set_xlim(-0.5, max(g.cells.shape[1] for g in grids.values()) - 0.5)
    axes[-1, 0].set_xlabel("iteration (within the run)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
