"""Gemma 3 270M (`make gemma3`) against llama.cpp's server and `transformers serve`.

Issue 50's Gemma rows: the same Q4_K_M GGUF served by Carousel (`carousel serve gemma-3-270m`,
the generic path over the conversion), by llama.cpp's `llama-server` (the GGUF itself, built
outside the repo: docs/benchmarks/history/25-single-stream-llamacpp.md) and by `transformers
serve --continuous-batching` (the same conversion). The base model has no chat template, so
every request is a completion. Per round, in turn on each server (rounds interleave, so slow
minutes of a shared machine fall on every server alike):

- burst: `carousel bench --endpoint completions --num-requests 64 --rate inf` with heavy-tailed
  output lengths (fresh prompts each round: the seed moves with the round);
- single stream: 16 requests one at a time, median ITL.

While one server is measured, the others are paused (SIGSTOP to their process groups, SIGCONT
after its turn), so an idle server takes nothing from it: with llama-server merely up beside
it, Carousel's burst measured 250-270 tok/s against 283-290 without it (two runs, Zen 4).
`--no-pause` keeps every server running throughout, as before.

Each burst also records its duration and the bench client's own CPU seconds during it
(`client_cpu_s`): the client shares the cores, and takes the same work in less time from a
faster server.

`transformers serve` rejects `ignore_eos`, so every server runs without it (`--no-ignore-eos`)
and output tok/s counts the tokens each actually sent. Every server listens on 127.0.0.1 and
is stopped by its pid (and wrapped in `timeout`). Writes `summary.json` under --out.

    .venv/bin/python scripts/gemma3_burst.py --llama-server /path/to/llama-server \
        --llama-no-repack --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_bench import PY, ROOT, bench, free_port, load, start, stop  # noqa: E402

MODEL = "gemma-3-270m"


def servers(args: argparse.Namespace, out: Path) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    """name -> (process, base URL) of every server asked for, each healthy."""
    from backends.torch.packaged_gguf import CHUNKED_GGUF

    gguf = CHUNKED_GGUF[MODEL]
    started: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        _start_all(args, out, gguf, started)
    except BaseException:
        for proc, _ in started.values():
            stop(proc)
        raise
    return started


def _start_all(
    args: argparse.Namespace,
    out: Path,
    gguf: Any,
    started: dict[str, tuple[subprocess.Popen[bytes], str]],
) -> None:
    """Start every server asked for into `started`, each once healthy."""
    port = free_port()
    cmd = [PY, "-m", "gateway.cli", "serve", MODEL, "--port", str(port),
           "--max-num-seqs", str(args.num_requests)]  # fmt: skip
    started["carousel"] = (
        start(cmd, f"http://127.0.0.1:{port}/health", out / "carousel.log"),
        f"http://127.0.0.1:{port}/v1",
    )
    if args.llama_server:
        port = free_port()
        cmd = [args.llama_server, "-m", str(gguf.gguf_path()), "--host", "127.0.0.1",
               "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads),
               "-np", str(args.llama_slots), "-c", str(args.llama_slots * 1024),
               "--no-webui", *(["--no-repack"] if args.llama_no_repack else [])]  # fmt: skip
        started["llama.cpp"] = (
            start(cmd, f"http://127.0.0.1:{port}/health", out / "llama.log"),
            f"http://127.0.0.1:{port}/v1",
        )
    if not args.skip_transformers:
        port = free_port()
        model_dir = str(gguf.converted_dir())
        cmd = [str(Path(PY).parent / "transformers"), "serve", model_dir,
               "--continuous-batching", "--device", "cpu", "--port", str(port),
               "--dtype", args.dtype]  # fmt: skip
        started["transformers"] = (
            start(cmd, f"http://127.0.0.1:{port}/health", out / "transformers.log"),
            f"http://127.0.0.1:{port}/v1",
        )


def model_name(url: str) -> str:
    """The one model the server lists."""
    import httpx

    return str(httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"])


def metrics(path: Path) -> dict[str, Any]:
    return dict(load(path)["runs"][0]["metrics"])


@contextlib.contextmanager
def alone(others: list[subprocess.Popen[bytes]], pause: bool) -> Iterator[None]:
    """The block with `others` paused (their process groups: `timeout` starts each server in
    its own), continued after it; nothing with `pause` off."""
    if pause:
        for proc in others:
            os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pause:
            for proc in others:
                os.killpg(proc.pid, signal.SIGCONT)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "gemma3")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--llama-slots", type=int, default=16, help="llama-server's -np")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument(
        "--llama-no-repack", action="store_true",
        help="llama-server's --no-repack (its repacked weights crashed on the AMX Xeon)",
    )  # fmt: skip
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", help="transformers serve's dtype")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=16)
    parser.add_argument(
        "--no-pause", dest="pause", action="store_false",
        help="keep the servers not being measured running (default: paused)",
    )  # fmt: skip
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    running = servers(args, out)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in running}
    try:
        names = {name: model_name(url) for name, (_, url) in running.items()}
        for r in range(args.rounds):
            order = list(running) if r % 2 == 0 else list(reversed(running))
            for name in order:
                others = [proc for other, (proc, _) in running.items() if other != name]
                with alone(others, args.pause):
                    measure_turn(args, out, name, r, running[name][1], names[name], results)
    finally:
        for proc, _ in running.values():
            stop(proc)
    summary = {
        name: {key: statistics.median(values) for key, values in row.items()}
        for name, row in results.items()
    }
    (out / "summary.json").write_text(json.dumps({"rounds": results, "median": summary}, indent=1))
    print(json.dumps(summary, indent=1))


def measure_turn(
    args: argparse.Namespace,
    out: Path,
    name: str,
    r: int,
    url: str,
    model: str,
    results: dict[str, dict[str, list[float]]],
) -> None:
    """Server `name`'s burst and single stream of round `r`, appended to `results`."""
    common = ["--url", url, "--model", model, "--endpoint", "completions",
              "--no-ignore-eos", "--no-trace", "--seed", str(100 + r)]  # fmt: skip
    burst = out / f"{name}-burst-{r}"
    bench([*common, "--num-requests", str(args.num_requests), "--rate", "inf",
           "--input-len", "uniform:16:64", "--output-len", "heavy-tail",
           "--out", str(burst)], [], quiet=True)  # fmt: skip
    single = out / f"{name}-single-{r}"
    bench([*common, "--num-requests", str(args.single_requests),
           "--max-concurrency", "1", "--input-len", "uniform:16:64",
           "--output-len", "fixed:128",
           "--out", str(single)], [], quiet=True)  # fmt: skip
    b, s = metrics(burst), metrics(single)
    row = results.setdefault(name, {})
    row.setdefault("burst_output_tok_s", []).append(b["output_throughput"])
    row.setdefault("burst_completed", []).append(b["completed"])
    # NOTE: the load the client put on the shared cores during the burst (bench/metrics.py)
    row.setdefault("burst_client_cpu_s", []).append(b["client_cpu_s"])
    row.setdefault("burst_duration_s", []).append(b["duration_s"])
    row.setdefault("single_median_itl_ms", []).append(s["itl_ms"]["p50"])
    print(name, r, json.dumps({k: v[-1] for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
