"""Prefix caching on against off, side by side on the default model; writes bench-results/.

One `carousel serve --config examples/prefix-cache.yaml` (arms `cache-on` and `cache-off`
over one shared copy of the weights), then `carousel bench` against both arms in turn, on
three workloads, each repeated with the order of the arms alternated:

1. shared prefix: `--num-requests` requests at a Poisson `--rate`, each a 512-word system
   prompt (the same for all) and its own question: p50 TTFT, off / on.
2. multi-turn: `--conversations` conversations of 8 turns (each turn sent when the previous
   answer arrived, with the history): p50 TTFT of turns 2..8, off / on.
3. no sharing: `make bench`'s heavy-tailed burst: output tok/s, on / off.

Every repeat has its own seed, so what the cache-on arm kept from one repeat is no help in
the next; the shared-prefix runs keep the bench's one warm-up request (the system prompt is
cached when the run starts, as on a server that has been up), the others have none. The
server listens on 127.0.0.1 only, runs under `timeout` and is stopped by its pid.

The server runs with OMP_NUM_THREADS=1 by default: on this machine's two cores, shared with
other sessions' processes, two OpenMP threads stall at every barrier whenever one of them is
descheduled (a 512-token prefill measured 2.4 s with one thread, 11 s with two, minutes apart).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_bench import (  # noqa: E402
    ROOT,
    SERVED,
    load,
    replace_section,
    serve_carousel,
    stop,
)
from reference_bench import bench as run_bench  # noqa: E402

ARMS = ("cache-on", "cache-off")
HEADER = "## Prefix caching on against off (`scripts/prefix_bench.py`)"


def bench(args: list[str], commands: list[str]) -> dict[str, dict[str, Any]]:
    """Run one `carousel bench`; its runs by arm."""
    run_bench(args, commands, quiet=True)
    report = load(Path(args[args.index("--out") + 1]))
    return {run["arm"]: run for run in report["runs"]}


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    common = ["--input-len", "uniform:16:64"]
    return {
        "shared": [*common, "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                   "--shared-prefix-len", "512", "--output-len", "32", "--warmups", "1"],
        "multi": [*common, "--num-requests", str(args.conversations), "--multi-turn", "8",
                  "--rate", str(args.conversation_rate), "--output-len", "32", "--warmups", "0"],
        "burst": [*common, "--num-requests", "64", "--rate", "inf", "--output-len", "heavy-tail",
                  "--warmups", "0"],
    }  # fmt: skip


def measure(run: dict[str, Any], workload: str) -> float:
    """The number each workload is judged on."""
    if workload == "shared":
        return float(run["metrics"]["ttft_ms"]["p50"])
    if workload == "multi":
        return float(run["prefix_cache"]["ttft_ms_later_turns"]["p50"])
    return float(run["metrics"]["output_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "prefix")
    parser.add_argument("--doc", type=Path, default=ROOT / "bench-results" / "prefix.md")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm per workload")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.5, help="shared prefix: req/s")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--conversation-rate", type=float, default=0.25)
    parser.add_argument("--workloads", default="shared,multi,burst")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--threads", default="1", help="OMP_NUM_THREADS of the server (1: see the module doc)"
    )
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ["CAROUSEL_DTYPE"] = args.dtype
    os.environ["OMP_NUM_THREADS"] = args.threads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    commands = [
        f"# carousel serve runs with CAROUSEL_DTYPE={args.dtype} OMP_NUM_THREADS={args.threads}"
    ]
    config = ["--config", "examples/prefix-cache.yaml"]
    server, url = serve_carousel(config, commands, out / "carousel.log")
    results: dict[str, list[dict[str, dict[str, Any]]]] = {}
    try:
        target = ["--url", f"{url}/v1", "--model", SERVED]
        warm = [*target, *(f"--arm={a}" for a in ARMS), "--num-requests", "4", "--seed", "999",
                "--warmups", "0", "--out", str(out / "warm-up")]  # fmt: skip
        bench(warm, [])  # unmeasured: the first forward passes of the process
        for name in args.workloads.split(","):
            for i in range(args.repeats):
                order = ARMS if i % 2 == 0 else ARMS[::-1]
                run_args = [*target, *(f"--arm={a}" for a in order), *workloads(args)[name],
                            "--seed", str(100 + i), "--out", str(out / f"{name}-{i}")]  # fmt: skip
                results.setdefault(name, []).append(bench(run_args, commands))
    finally:
        stop(server)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    write_doc(args, results, commands)


def spread(values: list[float], digits: int = 0) -> str:
    """`median (min-max)`."""
    fmt = f"{{:.{digits}f}}"
    median = fmt.format(statistics.median(values))
    return f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def rows(name: str, repeats: list[dict[str, dict[str, Any]]]) -> tuple[list[str], list[float]]:
    """Table rows per arm (median and range over repeats) and the per-repeat ratios."""
    lines = []
    for arm in ARMS:
        runs = [r[arm] for r in repeats]
        hit = [100 * (run["prefix_cache"]["hit_rate"] or 0) for run in runs]
        p50 = [float(run["metrics"]["ttft_ms"]["p50"]) for run in runs]
        later = [measure(run, "multi") for run in runs] if name == "multi" else None
        tput = [float(run["metrics"]["output_throughput"]) for run in runs]
        ok = sum(run["metrics"]["completed"] for run in runs)
        sent = sum(run["metrics"]["num_sent"] for run in runs)
        lines.append(
            f"| {arm} | {ok}/{sent} | {spread(hit, 1)} | {spread(p50)} | "
            f"{spread(later) if later else '-'} | {spread(tput, 1)} |"
        )
    if name == "burst":
        ratios = [measure(r["cache-on"], name) / measure(r["cache-off"], name) for r in repeats]
    else:
        ratios = [measure(r["cache-off"], name) / measure(r["cache-on"], name) for r in repeats]
    return lines, ratios


def write_doc(
    args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], commands: list[str]
) -> None:
    titles = {
        "shared": (
            f"Shared 512-word system prompt: {args.num_requests} requests, Poisson "
            f"{args.rate:g} req/s, questions uniform:16:64 words, 32 output tokens",
            "p50 TTFT off / on",
        ),
        "multi": (
            f"Multi-turn: {args.conversations} conversations of 8 turns (Poisson "
            f"{args.conversation_rate:g} conversations/s), questions uniform:16:64 words, "
            "answers 32 tokens",
            "p50 TTFT of turns 2..8, off / on",
        ),
        "burst": (
            "No sharing: `make bench`'s heavy-tailed burst (64 requests at once, input "
            "uniform:16:64 words, output lognormal median 48 capped at 256)",
            "output tok/s on / off",
        ),
    }
    lines = [
        HEADER,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this project's CPU machine (2 cores shared "
        f"with other sessions), default model ({args.dtype}, OMP_NUM_THREADS={args.threads}), "
        "one server with two arms over one copy of the weights (`examples/prefix-cache.yaml`: "
        f"orca, max_num_seqs 16, 0.5 GiB of KV each). Each workload ran {args.repeats} times "
        "per arm, the arms one after the other in alternating order, each repeat with its own "
        "seed; cells are the median and (min-max) over the repeats, ratios are per repeat (the "
        "two arms of one invocation).",
        "",
    ]
    for name, repeats in results.items():
        title, ratio_name = titles[name]
        table, ratios = rows(name, repeats)
        lines += [
            f"### {title}",
            "",
            "| arm | ok/sent | cache hit rate % | p50 TTFT ms | p50 TTFT turns 2..8 ms "
            "| output tok/s |",
            "|---|---|---|---|---|---|",
            *table,
            "",
            f"{ratio_name}: **{statistics.median(ratios):.2f}x** (per repeat: "
            f"{', '.join(f'{r:.2f}' for r in ratios)})",
            "",
        ]
    lines += ["Commands:", "", "```", *commands, "```", ""]
    replace_section(args.doc, HEADER, "\n".join(lines))


if __name__ == "__main__":
    main()
