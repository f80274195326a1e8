"""The iteration trace: picking an arm's window, stable seats, the carousel picture."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np

from bench.plots import comparison_figure, plot_carousel
from bench.trace import (
    ArmTrace,
    fetch_trace,
    parse_trace,
    seat_grid,
    server_root,
    trace_summary,
)


def it(i: int, *seqs: int, start: float | None = None) -> dict[str, Any]:
    """An iteration whose batch holds sequences `seqs` (request `r<seq>` each)."""
    return {
        "iteration": i,
        "start": 100.0 + i if start is None else start,
        "duration_s": 0.01,
        "seq_ids": list(seqs),
        "request_ids": [f"r{s}" for s in seqs],
        "num_prefill_tokens": 0,
        "num_decode_tokens": len(seqs),
        "num_running": len(seqs),
        "num_waiting": 0,
        "num_preempted": 0,
        "kv_usage": 0.1,
        "max_num_seqs": 4,
    }


def rows(iterations: list[dict[str, Any]], max_num_seqs: int = 4) -> list[list[int]]:
    """The grid as lists of request colours per seat (-1 = empty)."""
    return seat_grid(iterations, max_num_seqs).cells.tolist()


def test_server_root_strips_v1() -> None:
    assert server_root("http://h:8000/v1") == "http://h:8000"
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000/api") == "http://h:8000/api"


def test_parse_trace_keeps_the_arms_window_in_order() -> None:
    payload = {
        "arms": {
            "orca": {"max_num_seqs": 4, "iterations": [it(3, 1), it(1, 1), it(2, 1), it(9, 1)]},
            "static": {"max_num_seqs": 8, "iterations": [it(1, 5)]},
        }
    }
    trace = parse_trace(payload, "orca", (101.0, 103.0))
    assert trace.available and trace.max_num_seqs == 4
    assert [i["iteration"] for i in trace.iterations] == [1, 2, 3]


def test_parse_trace_explains_what_is_missing() -> None:
    window = (0.0, 1e12)
    assert "not Carousel" in (parse_trace({"detail": "x"}, "a", window).note or "")
    assert "not Carousel" in (parse_trace([1, 2], "a", window).note or "")
    two = {"arms": {"a": {"iterations": []}, "b": {"iterations": []}}}
    assert "--arm" in (parse_trace(two, None, window).note or "")
    assert "no iterations for arm 'c'" in (parse_trace(two, "c", window).note or "")
    empty = parse_trace({"arms": {"a": {"iterations": [it(0, 1)]}}}, "a", (0.0, 1.0))
    assert not empty.available and "window" in (empty.note or "")


def test_parse_trace_without_an_arm_takes_the_only_one() -> None:
    trace = parse_trace({"arms": {"only": {"iterations": [it(0, 1)]}}}, None, (0.0, 1e12))
    assert trace.available and trace.max_num_seqs == 4  # from the iteration records


def test_static_batch_leaves_a_staircase_of_empty_seats() -> None:
    trace = [it(0, 1, 2, 3, 4), it(1, 1, 2, 3), it(2, 1, 2), it(3, 1), it(4, 5, 6, 7, 8)]
    assert rows(trace) == [
        [0, 0, 0, 0, 4],
        [1, 1, 1, -1, 5],
        [2, 2, -1, -1, 6],
        [3, -1, -1, -1, 7],
    ]


def test_orca_refills_a_freed_seat_at_the_next_iteration() -> None:
    trace = [it(0, 1, 2), it(1, 1, 2), it(2, 1, 3), it(3, 3, 4), it(4, 4)]
    assert rows(trace, max_num_seqs=2) == [
        [0, 0, 0, 3, 3],  # r1 then r4
        [1, 1, 2, 2, -1],  # r2 then r3 in the seat r2 freed
    ]


def test_a_request_keeps_its_seat_across_a_short_absence() -> None:
    trace = [it(0, 1, 2), it(1, 2), it(2, 1, 2, 3)]
    grid = rows(trace, max_num_seqs=3)
    assert grid[0] == [0, -1, 0] and grid[1] == [1, 1, 1] and grid[2] == [-1, -1, 2]


def test_a_long_absence_frees_the_seat() -> None:
    trace = [it(0, 1), *(it(i, 2) for i in range(1, 8)), it(8, 1, 2)]
    grid = seat_grid(trace, 2, max_gap=2).cells
    assert grid[0, 1] == 1  # r2 took r1's seat once r1 had gone for long
    assert grid[:, 8].tolist() == [1, 0]  # r1 came back on the other seat


def test_more_sequences_than_max_num_seqs_add_rows() -> None:
    grid = seat_grid([it(0, 1, 2, 3)], max_num_seqs=2)
    assert grid.cells.shape == (3, 1) and grid.num_requests == 3


def test_occupancy_is_the_fraction_of_seat_iterations_used() -> None:
    grid = seat_grid([it(0, 1, 2), it(1, 1)], max_num_seqs=4)
    assert grid.occupancy == 3 / 8
    assert np.all(grid.cells[2:] == -1)


def test_carousel_picture_is_a_png_per_available_arm(tmp_path: Path) -> None:
    traces = {
        "static": ArmTrace([it(0, 1, 2), it(1, 1), it(2, 3, 4)], 2),
        "orca": ArmTrace([it(0, 1, 2), it(1, 1, 3), it(2, 3, 4)], 2),
        "missing": ArmTrace(note="404"),
    }
    path = plot_carousel(traces, tmp_path / "c.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
    assert plot_carousel({"x": ArmTrace(note="404")}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


async def test_fetch_trace_from_nowhere_is_a_note_not_an_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    trace = await fetch_trace(f"http://127.0.0.1:{port}", "a", (0.0, 1.0), timeout_s=2.0)
    assert not trace.available and "could not fetch" in (trace.note or "")


def test_a_trace_that_lost_the_runs_start_is_marked_truncated() -> None:
    payload = {"arms": {"a": {"iterations": [it(5, 2), it(6, 2, 3)]}}}
    trace = parse_trace(payload, "a", (104.5, 200.0))
    assert trace_summary(trace, num_completed=3)["truncated"]  # r1 finished before r2's start
    assert not trace_summary(trace, num_completed=2)["truncated"]
    whole = {"arms": {"a": {"iterations": [it(0, 1), it(5, 2), it(6, 2, 3)]}}}
    assert not trace_summary(parse_trace(whole, "a", (104.5, 200.0)), 3)["truncated"]


def test_the_comparison_plot_puts_ratios_on_a_log_axis_with_a_legend() -> None:
    def entry(label: str, diff: float, ci: list[float] | None, better: bool | None) -> dict:
        return {"label": label, "unit": "ms", "arm": "orca", "baseline": "static",
                "diff": diff, "ci95": ci, "better": better}  # fmt: skip

    fig = comparison_figure(
        [
            entry("p99 TTFT", 30.0, [22.0, 33.0], False),
            entry("p50 TPOT", -0.2, [-0.3, -0.1], True),
            entry("output tok/s", 0.02, None, None),
        ]  # fmt: skip
    )
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    low, high = ax.get_xlim()
    assert low < 0.8 and high > 31  # the x31 point and the x0.8 one both fit
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("better" in t for t in legend) and any("worse" in t for t in legend)
    assert "no interval (one run)" in legend
    assert "static" in ax.get_xlabel()
