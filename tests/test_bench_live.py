"""`carousel bench` end to end against a tiny fake OpenAI-compatible streaming server.

The fake server runs in a background uvicorn thread on a free loopback port. Per arm it keeps
a toy engine (the `static` arm batches request-level, any other arm refills seats every step
like Orca) that emits one token per running sequence per step and records each step as a
/debug/trace iteration, so the carousel picture has real staircases and refills to draw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class _Seq:
    seq_id: int
    request_id: str
    remaining: int
    tokens: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)


class ToyEngine:
    """One token per running sequence per step; `static` or Orca-style admission."""

    def __init__(self, policy: str, max_num_seqs: int, step_s: float) -> None:
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.iterations: list[dict[str, Any]] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def add(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.wake.set()
        if self.task is None:
            self.task = asyncio.create_task(self.loop())

    async def loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            self.step()
            await asyncio.sleep(self.step_s)

    def step(self) -> None:
        if self.policy != "static" or not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.popleft())
        batch = list(self.running)
        for seq in batch:
            seq.remaining -= 1
            seq.tokens.put_nowait(" tok")
            if seq.remaining <= 0:
                seq.tokens.put_nowait(None)
                self.running.remove(seq)
        self.iterations.append(
            {
                "iteration": len(self.iterations),
                "start": time.time(),
                "duration_s": self.step_s,
                "seq_ids": [s.seq_id for s in batch],
                "request_ids": [s.request_id for s in batch],
                "num_prefill_tokens": 0,
                "num_decode_tokens": len(batch),
                "num_running": len(self.running),
                "num_waiting": len(self.waiting),
                "num_preempted": 0,
                "kv_usage": 0.0,
                "max_num_seqs": self.max_num_seqs,
            }
        )


@dataclass
class FakeOptions:
    """How the fake server behaves."""

    trace: bool = True
    fail_every: int = 0  # per arm, the k-th, 2k-th... requests get HTTP 500
    usage: bool = True
    max_num_seqs: int = 4
    step_s: float = 0.004


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(opts: FakeOptions, seen: list[dict[str, Any]]) -> FastAPI:
    """The fake server's app; `seen` collects {arm, body} for every request."""
    app = FastAPI()
    engines: dict[str, ToyEngine] = {}
    counters: dict[str, int] = {}

    def engine(arm: str) -> ToyEngine:
        if arm not in engines:
            engines[arm] = ToyEngine(arm, opts.max_num_seqs, opts.step_s)
        return engines[arm]

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        arm = request.headers.get("x-carousel-arm", "default")
        seen.append({"arm": arm, "body": body})
        counters[arm] = counters.get(arm, 0) + 1
        if opts.fail_every and counters[arm] % opts.fail_every == 0:
            error = {"message": "boom", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=500)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        rid = f"req-{arm}-{counters[arm]}"
        seq = _Seq(len(seen), rid, int(body["max_tokens"]))
        engine(arm).add(seq)
        return StreamingResponse(
            _stream(seq, rid, len(prompt.split()), chat, body), media_type="text/event-stream"
        )

    async def _stream(
        seq: _Seq, rid: str, prompt_tokens: int, chat: bool, body: dict[str, Any]
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": kind, "created": 0, "model": body["model"]}

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return _sse({**base, "choices": [choice], "usage": None})

        if chat:
            yield chunk(None, role=True)
        n = 0
        while (token := await seq.tokens.get()) is not None:
            n += 1
            yield chunk(token)
        yield chunk(None, finish="length")
        if opts.usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            usage["total_tokens"] = prompt_tokens + n
            yield _sse({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.get("/debug/trace")
    async def trace(arm: str | None = None) -> Response:
        if not opts.trace:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        names = [arm] if arm is not None else list(engines)
        arms = {
            name: {"max_num_seqs": e.max_num_seqs, "iterations": e.iterations}
            for name in names
            if (e := engines.get(name)) is not None
        }
        return JSONResponse({"arms": arms})

    return app


@contextlib.contextmanager
def fake_server(opts: FakeOptions | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Serve the fake app on a free loopback port; yields (base URL, requests seen)."""
    seen: list[dict[str, Any]] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(opts or FakeOptions(), seen), log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def bench_args(url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--url", f"{url}/v1", "--model", "toy", "--num-requests", "8",
        "--input-len", "fixed:16", "--output-len", "uniform:2:12",
        "--out", str(out), "--no-progress", "--warmups", "0", *extra,
    ]  # fmt: skip


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, path


def test_two_arm_bench_writes_sane_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server() as (url, seen):
        rc = main(bench_args(url, out, "--arm", "static", "--arm", "orca",
                             "--slo-ttft", "10000", "--slo-tpot", "10000"))  # fmt: skip
    assert rc == 0
    assert [s["arm"] for s in seen] == ["static"] * 8 + ["orca"] * 8
    body = seen[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    per_arm = [
        {s["body"]["messages"][0]["content"]: s["body"]["max_tokens"] for s in part}
        for part in (seen[:8], seen[8:])
    ]
    assert per_arm[0] == per_arm[1] and len(per_arm[0]) == 8  # the same workload for both arms

    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == 1 and report["interrupted"] is False
    assert report["config"]["arms"] == ["static", "orca"]
    assert [r["arm"] for r in report["runs"]] == ["static", "orca"]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["cancelled"]) == (8, 0, 0)
        assert m["total_output_tokens"] == sum(s["body"]["max_tokens"] for s in seen[:8])
        assert m["total_input_tokens"] == 8 * 16
        assert m["request_throughput"] > 0 and m["output_throughput"] > 0
        assert m["goodput"] == pytest.approx(m["request_throughput"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            stats = m[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
        assert m["ttft_ms"]["p99"] <= m["e2e_latency_ms"]["p99"]
        assert run["mean_prompt_tokens"] == 16
        trace = run["trace"]
        assert trace["available"] is True and trace["max_num_seqs"] == 4
        assert 0 < trace["seat_occupancy"] <= 1 and 0 < trace["mean_batch_size"] <= 4
        # one token per sequence per toy step: the run's steps cover the longest request
        assert trace["num_iterations"] >= max(s["body"]["max_tokens"] for s in seen[:8])
    assert report["comparison"][0]["baseline"] == "static"
    assert report["comparison"][0]["arm"] == "orca"

    assert sorted(report["files"]["plots"]) == ["carousel.png", "latency_cdf.png"]
    for name in report["files"]["plots"]:
        assert_png(out / name)
    md = (out / "report.md").read_text()
    assert "## Throughput" in md and "![" in md and "carousel.png" in md
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 16 and json.loads(lines[0])["success"] is True


def test_missing_trace_and_failed_requests_are_reported(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(trace=False, fail_every=4, usage=False)) as (url, _):
        rc = main(bench_args(url, out, "--arm", "orca", "--endpoint", "completions",
                             "--rate", "200", "--no-ignore-eos"))  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    m = report["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (6, 2)
    assert report["runs"][0]["errors"] == {"HTTP 500: boom": 2}
    assert m["goodput"] is None and m["total_input_tokens"] == 0
    assert m["total_output_tokens"] > 0  # counted from content chunks: no usage chunk
    assert report["runs"][0]["trace"]["available"] is False
    assert report["files"]["plots"] == ["latency_cdf.png"]
    assert not (out / "carousel.png").exists()
    assert any("/debug/trace" in note for note in report["notes"])
    md = (out / "report.md").read_text()
    assert "No carousel picture" in md and "HTTP 500: boom" in md


def test_sweep_draws_throughput_against_rate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server() as (url, seen):
        rc = main(bench_args(url, out, "--arm", "orca", "--sweep-rates", "100,400",
                             "--num-requests", "4", "--warmups", "1"))  # fmt: skip
    assert rc == 0 and len(seen) == 2 * (1 + 4)  # one unmeasured warm-up request per run
    report = json.loads((out / "report.json").read_text())
    assert [r["rate"] for r in report["runs"]] == [100.0, 400.0]
    assert [r["metrics"]["completed"] for r in report["runs"]] == [4, 4]
    assert sorted(report["files"]["plots"]) == [
        "carousel_rate100.png", "carousel_rate400.png",
        "latency_cdf_rate100.png", "latency_cdf_rate400.png", "sweep.png",
    ]  # fmt: skip
    assert_png(out / "sweep.png")


def test_no_server_fails_every_request_and_exits_nonzero(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    rc = main(bench_args(f"http://127.0.0.1:{port}", tmp_path, "--num-requests", "2"))
    assert rc == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["runs"][0]["metrics"]["failed"] == 2


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_stops_cleanly_and_still_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(step_s=0.05)) as (url, seen):
        args = bench_args(url, out, "--arm", "a", "--arm", "b", "--output-len", "fixed:200")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while len(seen) < 8:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr.decode()
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True
    assert [r["arm"] for r in report["runs"]] == ["a"]  # arm b never started
    m = report["runs"][0]["metrics"]
    assert m["cancelled"] == 8 and m["completed"] == 0
    assert (out / "report.md").exists()


def test_verdict_compares_the_arms_schedules(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # toy steps far longer than the burst's spread: most arrivals land in the same step
    with fake_server(FakeOptions(step_s=0.05)) as (url, _):
        rc = main(bench_args(url, out, "--arm", "orca", "--arm", "orca-again", "--arm", "static"))
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for entry in report["comparison"]:
        by_arm.setdefault(entry["arm"], []).append(entry)
    assert {e["same_schedule"] for e in by_arm["static"]} == {False}
    again = {e["schedule_similarity"] for e in by_arm["orca-again"]}
    assert len(again) == 1 and 0 < again.pop() <= 1
