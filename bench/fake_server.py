"""A tiny fake OpenAI-compatible streaming server for exercising `carousel bench` offline.

It runs in a background uvicorn thread on a free loopback port. Per arm it keeps a toy engine
(the `static` arm batches request-level, any other arm refills seats every step like Orca) that
emits one token per running sequence per step and records each step as a /debug/trace
iteration, so the carousel picture has real staircases and refills to draw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class _Seq:
    seq_id: int
    request_id: str
    remaining: int
    tokens: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    token: str = " tok"  # what each step emits for it


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
            seq.tokens.put_nowait(seq.token)
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
    models: tuple[str, ...] | None = None  # served names (others: 404); None serves any
    refuse_ignore_eos: bool = False  # 400 for a body with ignore_eos, as OpenAI's API does
    #: the bodies of the bench's probe requests (header X-Carousel-Bench: probe), kept out of
    #: `seen` and the failure counters: they are not the workload
    probes: list[dict[str, Any]] = field(default_factory=list)
    #: per arm, every k-th request of it answers " other" tokens instead of " tok" (answers
    #: that differ from another arm's; by default every arm answers every prompt alike)
    answer_changes: dict[str, int] = field(default_factory=dict)
    #: what `/health` names as each local arm's CPU-kernel path (`model/arm` -> `torch`,
    #: `building`, `carousel`; bench/kernels_wait.py); None: a `/health` without the field.
    #: Mutable: a test flips it while the bench waits
    kernels: dict[str, str] | None = None
    #: the paths `kernels` takes once the workload's first request arrives (a switch mid-run)
    kernels_mid_run: dict[str, str] | None = None


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

    def refusal(status: int, message: str, param: str | None, code: str) -> Response:
        error = {"message": message, "type": "invalid_request_error", "param": param}
        return JSONResponse({"error": {**error, "code": code}}, status_code=status)

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        arm = request.headers.get("x-carousel-arm", "default")
        if opts.models is not None and body.get("model") not in opts.models:
            message = f"The model `{body.get('model')}` does not exist."
            return refusal(404, message, "model", "model_not_found")
        if opts.refuse_ignore_eos and "ignore_eos" in body:
            message = "Unrecognized request argument supplied: ignore_eos"
            return refusal(400, message, None, "unknown_parameter")
        if request.headers.get("x-carousel-bench") == "probe":
            opts.probes.append({"arm": arm, "body": body})
            seq = _Seq(0, "probe", int(body["max_tokens"]))
            engine(arm).add(seq)
            return StreamingResponse(
                _stream(seq, "probe", len(_prompt(body, chat).split()), chat, body),
                media_type="text/event-stream",
            )
        seen.append({"arm": arm, "body": body})
        if opts.kernels_mid_run is not None:
            opts.kernels = opts.kernels_mid_run
        counters[arm] = counters.get(arm, 0) + 1
        if opts.fail_every and counters[arm] % opts.fail_every == 0:
            error = {"message": "boom", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=500)
        rid = f"req-{arm}-{counters[arm]}"
        seq = _Seq(len(seen), rid, int(body["max_tokens"]))
        every = opts.answer_changes.get(arm, 0)
        if every and counters[arm] % every == 0:
            seq.token = " other"
        engine(arm).add(seq)
        return StreamingResponse(
            _stream(seq, rid, len(_prompt(body, chat).split()), chat, body),
            media_type="text/event-stream",
        )

    def _prompt(body: dict[str, Any], chat: bool) -> str:
        return str(body["messages"][-1]["content"] if chat else body["prompt"])

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

    @app.get("/health")
    async def health() -> Response:
        if opts.kernels is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "kernels": dict(opts.kernels)})

    @app.get("/v1/models")
    async def models() -> Response:
        names = opts.models if opts.models is not None else ("toy",)
        data = [{"id": name, "object": "model", "owned_by": "fake"} for name in names]
        return JSONResponse({"object": "list", "data": data})

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
