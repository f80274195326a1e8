"""What `carousel bench` prints when it is done: a results block like `vllm bench serve`'s and
the verdict lines, read from report.json so the terminal and the files never disagree.

One block per rate, one column per run (the baseline's first), rows for requests ok/failed,
duration, throughputs, goodput against `--slo`, speculative decoding's mean acceptance length
and draft acceptance rate (where an arm verified drafts: its iteration trace), and TTFT, TPOT
and ITL at p50, p90 and p99.
Then, per candidate arm, the verdict's sentences with their 95% intervals against the baseline,
better and worse marked, and the most frequent errors of any run that had some.
"""

from __future__ import annotations

from typing import Any

WIDTH = 72
LABEL_WIDTH = 34
PERCENTILES = ("p50", "p90", "p99")
COUNTS = (
    ("Benchmark duration (s)", "duration_s"),
    ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Output token throughput (tok/s)", "output_throughput"),
)
LATENCIES = (
    ("ttft_ms", "Time to First Token (ms)"),
    ("tpot_ms", "Time per Output Token, excl. 1st (ms)"),
    ("itl_ms", "Inter-token Latency (ms)"),
)


def _rate(rate: Any) -> str:
    return "inf" if rate == "inf" else f"{rate:g}"


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _rule(title: str = "", fill: str = "-") -> str:
    return f" {title} ".center(WIDTH, fill) if title else fill * WIDTH


def _row(label: str, cells: list[str], width: int) -> str:
    return label.ljust(LABEL_WIDTH) + "".join(c.rjust(width) for c in cells)


def results_block(report: dict[str, Any]) -> list[str]:
    """The results table of every rate (see the module docstring)."""
    lines: list[str] = []
    runs = report["runs"]
    repeats = report["config"].get("repeats", 1)
    slo = report["config"].get("slo_ttft_ms") is not None or report["config"].get("slo_tpot_ms")
    for rate in dict.fromkeys(r["rate"] for r in runs):
        at_rate = [r for r in runs if r["rate"] == rate]
        names = [r["arm"] + (f" #{r['repeat'] + 1}" if repeats > 1 else "") for r in at_rate]
        width = max(14, *(len(n) + 2 for n in names))
        m = [r["metrics"] for r in at_rate]
        rate_text = "replay" if report["config"].get("replay") else f"{_rate(rate)} req/s"
        lines += [_rule(f"Serving Benchmark Result @ {rate_text}", "="), _row("", names, width)]
        rows = [
            ("Requests ok / failed", [f"{x['completed']} / {x['failed']}" for x in m]),
            *((label, [_num(x[key]) for x in m]) for label, key in COUNTS),
        ]
        if all(x.get("client_cpu_s") is not None for x in m):
            rows.append(("Client CPU time (s)", [_num(x["client_cpu_s"]) for x in m]))
        if slo:
            share = ["-" if x["goodput_share"] is None else f"{x['goodput_share']:.0%}" for x in m]
            rows.append(("Goodput (req/s)", [_num(x["goodput"]) for x in m]))
            rows.append(("Requests meeting --slo", share))
        lines += [_row(label, cells, width) for label, cells in rows]
        lines += _acceptance_rows(at_rate, width)
        for key, title in LATENCIES:
            lines.append(_rule(title))
            for p in PERCENTILES:
                lines.append(_row(f"{p.upper()}", [_num(x[key][p]) for x in m], width))
        lines.append(_rule(fill="="))
        for run, name in zip(at_rate, names, strict=True):
            for message, count in list(run["errors"].items())[:3]:
                lines.append(f"errors of {name}: {count} x {message}")
    return lines


def _acceptance_rows(runs: list[dict[str, Any]], width: int) -> list[str]:
    """vLLM's speculative decoding rows (mean acceptance length, draft acceptance rate) from
    each run's iteration trace; none when no run at this rate verified drafts."""
    traces = [r.get("trace") or {} for r in runs]
    if not any(t.get("num_drafts") for t in traces):
        return []
    rates = [
        t["num_accepted_tokens"] / t["num_draft_tokens"] if t.get("num_draft_tokens") else None
        for t in traces
    ]
    return [
        _row(
            "Mean acceptance length", [_num(t.get("mean_acceptance_length")) for t in traces], width
        ),
        _row("Draft acceptance rate", ["-" if r is None else f"{r:.0%}" for r in rates], width),
    ]


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """Per rate and candidate arm: what it buys against the baseline, with 95% intervals."""
    entries = report["comparison"]
    if not entries:
        return []
    lines: list[str] = []
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault((entry["rate"], entry["arm"]), []).append(entry)
    replay = bool(report["config"].get("replay"))
    for (rate, arm), rows in groups.items():
        base = rows[0]["baseline"]
        where = "on the replayed trace" if replay else f"@ {_rate(rate)} req/s"
        lines += ["", f"Verdict {where}: what {arm} buys against {base} (the baseline)"]
        for row in rows:
            mark = {True: "better", False: "worse"}.get(row["better"], "")
            lines.append(f"  {mark:>6}  {row['sentence']}")
        if rows[0].get("same_schedule"):
            lines.append(f"  note: {arm} and {base} ran the same iteration schedule")
    return lines


def answer_lines(report: dict[str, Any]) -> list[str]:
    """Per rate and candidate arm: the share of its greedy answers equal to the baseline's."""
    entries = report.get("identical_answers", [])
    return [f"@ {_rate(e['rate'])} req/s: {e['sentence']}" for e in entries]


def terminal_lines(report: dict[str, Any], notes: list[str]) -> list[str]:
    """Everything the bench prints after its runs: the results, the verdict, the identical
    greedy answers, `notes`."""
    return [
        *results_block(report),
        *verdict_lines(report),
        *answer_lines(report),
        *(f"note: {n}" for n in notes),
    ]
