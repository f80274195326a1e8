"""Single-stream latency: one streamed greedy answer at a time, endpoints taken in turn.

    python scripts/single_stream.py --rounds 20 --llama-server llama.cpp-build/bin/llama-server \
        --quantization none --quantization gguf

Each endpoint is an OpenAI-compatible server: `--url NAME=URL` (already running), `--carousel
NAME=ARGS` (`carousel serve ARGS` started here; `--quantization MODE` is `--carousel
"MODE=--quantization MODE"`) or `--llama-server PATH` (llama.cpp's server started here on the
same GGUF as Carousel's default model, `-t 2`, one slot; named `llama.cpp`, and the first
endpoint when given; docs/benchmarks/history/25-single-stream-llamacpp.md builds it). Servers
started here listen on free loopback ports, are wrapped in `timeout` (an hour) and are ended
by their own pid.

One round sends each endpoint, in turn, the same chat request (`max_tokens`, temperature 0,
`ignore_eos`), so a load spike on a shared machine lands on all of them alike; one untimed
warm-up request each goes first. Per endpoint it prints the median inter-token latency (the
gap between streamed chunks), the decode time per token ((last chunk - first chunk) / (tokens
- 1)), the median time to first token, and the first endpoint's median ITL over each one's
(above 1: faster than the first). No round starts after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from reference_bench import free_port, start, stop  # noqa: E402

from backends.torch.loader import default_gguf_path  # noqa: E402
from bench.client import ClientConfig, RequestResult, send_request  # noqa: E402
from bench.workload import RequestSpec  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
LLAMA_CPP = "llama.cpp"


@dataclass
class Endpoint:
    """One server under test and what its answers measured."""

    name: str
    url: str
    model: str = ""
    itl: list[float] = field(default_factory=list)
    per_token: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def named(value: str) -> tuple[str, str]:
    """`NAME=REST` split at the first `=`."""
    name, sep, rest = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {value!r}")
    return name, rest


def llama_server_cmd(binary: str, port: int, threads: int) -> list[str]:
    """llama.cpp's server on Carousel's default GGUF: one slot, `threads` threads, loopback."""
    return [
        binary, "-m", str(default_gguf_path()), "--host", "127.0.0.1",
        "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "2048",
        "--alias", "default",
    ]  # fmt: skip


def carousel_cmd(args: str, port: int) -> list[str]:
    """`carousel serve ARGS` (this checkout's code: scripts run from the repo root)."""
    serve = [sys.executable, "-m", "gateway.cli", "serve", *shlex.split(args)]
    return [*serve, "--host", "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def servers(args: argparse.Namespace, log_dir: Path) -> Iterator[list[Endpoint]]:
    """Every endpoint, those started here healthy; ends them (by pid) on the way out."""
    started: list[subprocess.Popen[bytes]] = []
    endpoints: list[Endpoint] = []
    try:
        launches: list[tuple[str, list[str], int]] = []
        if args.llama_server:
            port = free_port()
            cmd = llama_server_cmd(args.llama_server, port, args.threads)
            launches.append((LLAMA_CPP, cmd, port))
        arms = [*args.carousel, *((mode, f"--quantization {mode}") for mode in args.quantization)]
        for name, rest in arms:
            port = free_port()
            launches.append((name, carousel_cmd(rest, port), port))
        for name, cmd, port in launches:
            url = f"http://127.0.0.1:{port}"
            started.append(start(cmd, f"{url}/health", log_dir / f"{name}.log"))
            endpoints.append(Endpoint(name, f"{url}/v1"))
        endpoints += [Endpoint(name, url.rstrip("/")) for name, url in args.url]
        for endpoint in endpoints:
            models = httpx.get(f"{endpoint.url}/models", timeout=30).json()
            endpoint.model = models["data"][0]["id"]
        yield endpoints
    finally:
        for proc in started:
            stop(proc)


async def answer(endpoint: Endpoint, max_tokens: int) -> RequestResult:
    """One streamed greedy answer of `max_tokens` tokens from `endpoint`."""
    cfg = ClientConfig(api_base=endpoint.url, model=endpoint.model, timeout_s=120.0)
    spec = RequestSpec(index=0, max_tokens=max_tokens, prompt=PROMPT)
    result = RequestResult(index=0, max_tokens=max_tokens)
    async with httpx.AsyncClient(timeout=None) as client:
        await send_request(client, cfg, spec, None, result, time.perf_counter())
    if not result.success or result.ttft is None or result.latency is None:
        raise RuntimeError(f"{endpoint.name}: {result.error or 'no tokens streamed'}")
    return result


def record(endpoint: Endpoint, result: RequestResult) -> None:
    """Keep one answer's timings on `endpoint`."""
    tokens = result.usage_output_tokens or result.num_chunks
    assert result.ttft is not None and result.latency is not None  # see answer
    decode_s = sum(result.itl)
    endpoint.itl += result.itl
    endpoint.ttft.append(result.ttft)
    endpoint.tokens.append(tokens)
    if tokens > 1:
        endpoint.per_token.append(decode_s / (tokens - 1))


async def measure(
    endpoints: list[Endpoint], rounds: int, max_tokens: int, max_seconds: float
) -> None:
    """A warm-up answer each, then `rounds` rounds of one answer per endpoint in turn; no
    round starts after `max_seconds` (a loaded machine: what was measured is reported)."""
    for endpoint in endpoints:
        await answer(endpoint, max_tokens)
    deadline = time.monotonic() + max_seconds
    for i in range(rounds):
        if time.monotonic() > deadline:
            print(f"time budget spent after {i} rounds", file=sys.stderr, flush=True)
            break
        for endpoint in endpoints:
            record(endpoint, await answer(endpoint, max_tokens))
        done = ", ".join(f"{e.name} {e.per_token[-1] * 1e3:.1f}" for e in endpoints)
        print(f"round {i + 1}/{rounds}, ms/token: {done}", file=sys.stderr, flush=True)


def report(endpoints: list[Endpoint]) -> list[dict[str, float | str]]:
    """Per endpoint: medians in ms and the first endpoint's median ITL over its own."""
    base = statistics.median(endpoints[0].itl)
    rows: list[dict[str, float | str]] = []
    for e in endpoints:
        itl = statistics.median(e.itl)
        rows.append({
            "endpoint": e.name,
            "median_itl_ms": round(itl * 1e3, 2),
            "p90_itl_ms": round(statistics.quantiles(e.itl, n=10)[-1] * 1e3, 2),
            "decode_ms_per_token": round(statistics.median(e.per_token) * 1e3, 2),
            "median_ttft_ms": round(statistics.median(e.ttft) * 1e3, 1),
            "tokens_per_answer": statistics.median(e.tokens),
            "answers": len(e.ttft),
            "itl_speedup_vs_first": round(base / itl, 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", type=named, action="append", default=[], help="NAME=URL")
    parser.add_argument("--carousel", type=named, action="append", default=[], help="NAME=ARGS")
    parser.add_argument(
        "--quantization", action="append", default=[],
        help="MODE: a Carousel endpoint named MODE, `--carousel \"MODE=--quantization MODE\"`",
    )  # fmt: skip
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=1200, help="start no round after")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench-results" / "single-stream")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with servers(args, args.log_dir) as endpoints:
        if not endpoints:
            parser.error("no endpoint: give --url, --carousel or --llama-server")
        asyncio.run(measure(endpoints, args.rounds, args.max_tokens, args.max_seconds))
    rows = report(endpoints)
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
