"""Record, then replay: the recorder's file drives `carousel bench --replay`.

Arrival offsets are reproduced within 50 ms (at the client against the live simulator server,
at the server against a small fake one), each request keeps its own endpoint and parameters,
redacted records come back with synthetic text of their recorded length, and the Responses
API's typed SSE events are read (text deltas for TTFT, usage from `response.completed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from bench.cli import main
from bench.client import ClientConfig, build_body
from bench.replay import load_records, replay_workload
from gateway.obs.traffic_record import TrafficEntry, TrafficRecorder
from tests.conftest import SIM_MODEL, LiveServer

TOLERANCE_S = 0.05
#: what the gateway writes as a record's endpoint: its path
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}  # fmt: skip
OFFSETS = [0.0, 0.05, 0.3, 0.32, 0.6, 0.9, 0.95, 1.3]


def record_file(path: Path, bodies: list[tuple[str, dict[str, Any]]], **kw: Any) -> Path:
    """A record of `bodies` (endpoint, body) arriving at OFFSETS, as the gateway would write."""
    recorder = TrafficRecorder(path, **kw)
    t0 = time.monotonic()
    for (endpoint, body), offset in zip(bodies, OFFSETS, strict=False):
        tokens = body.get("max_tokens") or body.get("max_output_tokens") or 4
        recorder.record(
            TrafficEntry(t0 + offset, PATHS[endpoint], body, "orca", status=200,
                         prompt_tokens=60, completion_tokens=tokens, ttft_s=0.01, e2e_s=0.1)
        )  # fmt: skip
    recorder.close()
    return path


def test_records_replay_in_arrival_order_with_their_own_parameters(tmp_path: Path) -> None:
    recorder = TrafficRecorder(tmp_path / "t.jsonl")
    t0 = time.monotonic()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0.7, "response_format": {"type": "json_object"},
            "stream": False}  # fmt: skip
    later = {"model": "m", "prompt": "once", "max_tokens": 3, "seed": 4}
    resp = {"model": "m", "input": "hey", "max_output_tokens": 6, "previous_response_id": "r1"}
    # written in finishing order, not arrival order
    recorder.record(TrafficEntry(t0 + 1.0, "/v1/completions", later, "a", completion_tokens=3))
    recorder.record(TrafficEntry(t0 + 0.2, "/v1/chat/completions", chat, "b", completion_tokens=5))
    recorder.record(TrafficEntry(t0 + 1.6, "/v1/responses", resp, "a", completion_tokens=6))
    recorder.record(TrafficEntry(t0 + 2.0, "/v1/embeddings", {"input": "x"}, "a"))
    recorder.close()
    records, skipped = load_records([tmp_path / "t.jsonl"])
    assert [r.endpoint for r in records] == ["chat", "completions", "responses"]
    assert skipped == {"endpoint /v1/embeddings": 1}
    workload = replay_workload(records, time_scale=0.5, model="served")
    assert [round(o, 3) for o in workload.offsets] == [0.0, 0.4, 0.7]
    first, second, third = workload.specs
    assert first.body is not None and first.body["temperature"] == 0.7
    assert first.body["response_format"] == {"type": "json_object"}
    assert first.body["model"] == "served" and "ignore_eos" not in first.body  # not pinned
    cfg = ClientConfig(api_base="x", model="ignored")
    sent = build_body(cfg, first)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == chat["messages"] and sent["model"] == "served"
    assert build_body(cfg, second)["seed"] == 4 and second.endpoint == "completions"
    assert third.body is not None and "previous_response_id" not in third.body
    assert "stream_options" not in build_body(cfg, third)  # Responses: usage comes at the end
    assert workload.offered_rate == pytest.approx(2 / 0.7, rel=1e-3)


def test_redacted_records_get_synthetic_text_of_the_recorded_length(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 300}]
    body = {"model": "m", "max_tokens": 50, "stop": ["\n"], "messages": messages}
    path = tmp_path / "t.jsonl"
    recorder = TrafficRecorder(path, redact=True)
    chat = "/v1/chat/completions"
    recorder.record(TrafficEntry(time.monotonic(), chat, body, "a", prompt_tokens=128,
                                 completion_tokens=17))  # fmt: skip
    recorder.record(
        TrafficEntry(time.monotonic(), "/v1/completions", {"prompt": [5, 6, 7, 8]}, "a")
    )
    recorder.close()
    assert "uuu" not in path.read_text()
    records, _ = load_records([path])
    chat, ids = replay_workload(records).specs
    assert chat.body is not None and ids.body is not None
    system, user = (m["content"] for m in chat.body["messages"])
    budget = 128 - 2 * 4  # the recorded prompt, less the template's share
    assert len(system.split()) == budget // 4 and len(user.split()) == budget * 3 // 4
    assert chat.body["max_tokens"] == 17 and chat.body["ignore_eos"] is True  # pinned
    assert "stop" not in chat.body and chat.max_tokens == 17
    assert len(ids.body["prompt"].split()) == 4  # token ids become as many words


async def _drive(url: str, bodies: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """Send `bodies` at OFFSETS to a live server, recording each as the gateway hook would."""
    recorder = TrafficRecorder(path)
    paths = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(endpoint: str, body: dict[str, Any], offset: float) -> None:
            await asyncio.sleep(offset)
            arrival = time.monotonic()
            reply = await client.post(paths[endpoint], json=body)
            usage = reply.json()["usage"]
            recorder.record(
                TrafficEntry(arrival, endpoint, body, reply.headers.get("x-carousel-arm"),
                             status=reply.status_code, prompt_tokens=usage["prompt_tokens"],
                             completion_tokens=usage["completion_tokens"],
                             e2e_s=time.monotonic() - arrival)
            )  # fmt: skip

        await asyncio.gather(*(one(e, b, o) for (e, b), o in zip(bodies, OFFSETS, strict=True)))
    recorder.close()


def live_bodies() -> list[tuple[str, dict[str, Any]]]:
    bodies: list[tuple[str, dict[str, Any]]] = []
    for i in range(len(OFFSETS)):
        if i % 2:
            body = {"model": SIM_MODEL, "prompt": f"request {i} " * (i + 1), "max_tokens": 2 + i}
            bodies.append(("completions", body))
        else:
            messages = [{"role": "user", "content": f"question {i} " * (i + 2)}]
            body = {"model": SIM_MODEL, "messages": messages, "max_tokens": 3 + i, "seed": i}
            bodies.append(("chat", {**body, "temperature": 0.8}))
    return bodies


@pytest.mark.usefixtures("no_gc_pauses")
def test_record_then_replay_against_a_live_server(
    tmp_path: Path, make_server: Callable[..., LiveServer]
) -> None:
    server = make_server()
    path = tmp_path / "traffic.jsonl"
    asyncio.run(_drive(server.url, live_bodies(), path))
    recorded = sorted(map(json.loads, path.open()), key=lambda r: r["t"])
    out = tmp_path / "out"
    argv = ["--url", server.v1, "--replay", str(path), "--out", str(out), "--no-progress",
            "--warmups", "0", "--no-trace"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["replay"]["num_records"] == len(OFFSETS)
    assert report["runs"][0]["metrics"]["completed"] == len(OFFSETS)
    sent = [json.loads(line) for line in (out / "requests.jsonl").open()]
    assert len(sent) == len(recorded)
    for line in sent:
        rec = recorded[line["index"]]  # the replay sends the records in arrival order
        assert line["max_tokens"] == rec["body"]["max_tokens"]
        assert abs(line["send_time_s"] - (rec["t"] - recorded[0]["t"])) < TOLERANCE_S, line
        # the same body to the same server: the same prompt, the same number of tokens
        assert line["prompt_tokens"] == rec["outcome"]["prompt_tokens"]
        assert line["output_tokens"] == rec["outcome"]["completion_tokens"]


# -- a fake server that notes when each request arrives, and speaks /v1/responses -------------


def fake_app(arrivals: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    async def note(request: Request) -> dict[str, Any]:
        body = await request.json()
        arm = request.headers.get("x-carousel-arm")
        if request.headers.get("x-carousel-bench") != "probe":  # the workload's arrivals only
            arrivals.append(
                {"t": time.monotonic(), "arm": arm, "path": request.url.path, "body": body}
            )
        return body

    def sse(event: str | None, data: dict[str, Any]) -> str:
        return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"

    async def responses_stream(body: dict[str, Any]) -> AsyncIterator[str]:
        n = body["max_output_tokens"]
        seq = iter(range(1000))
        yield sse("response.created", {"type": "response.created", "sequence_number": next(seq)})
        for _ in range(n):
            await asyncio.sleep(0.002)
            delta = {"type": "response.output_text.delta", "delta": " w", "item_id": "msg_1",
                     "output_index": 0, "content_index": 0,
                     "sequence_number": next(seq)}  # fmt: skip
            yield sse(delta["type"], delta)
        usage = {"input_tokens": len(body["input"].split()), "output_tokens": n, "total_tokens": 0}
        done = {"type": "response.completed", "sequence_number": next(seq),
                "response": {"id": "resp_1", "status": "completed", "usage": usage}}  # fmt: skip
        yield sse(done["type"], done)

    async def chat_stream(body: dict[str, Any]) -> AsyncIterator[str]:
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            yield sse(None, {"choices": [{"index": 0, "delta": {"content": " w"}}]})
        usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
        yield sse(None, {"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await note(request)
        return StreamingResponse(responses_stream(body), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await note(request)
        return StreamingResponse(chat_stream(body), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.usefixtures("no_gc_pauses")
def test_replay_reproduces_arrivals_at_the_server_and_speaks_responses(tmp_path: Path) -> None:
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("responses", {"model": "m", "input": "a b c d", "max_output_tokens": 4 + i})
        if i % 2
        else (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        )
        for i in range(len(OFFSETS))
    ]
    path = record_file(tmp_path / "t.jsonl", bodies)
    arrivals: list[dict[str, Any]] = []
    out = tmp_path / "out"
    with serve(fake_app(arrivals)) as url:
        argv = ["--url", url, "--replay", str(path), "--time-scale", "0.5", "--arm", "static",
                "--arm", "orca", "--out", str(out), "--no-progress", "--warmups", "0",
                "--no-trace", "--resamples", "200"]  # fmt: skip
        assert main(argv) == 0
    for arm in ("static", "orca"):
        mine = [a for a in arrivals if a["arm"] == arm]
        assert [a["path"].rsplit("/", 1)[-1] for a in mine] == [
            "responses" if i % 2 else "completions" for i in range(len(OFFSETS))
        ]
        seen = [a["t"] - mine[0]["t"] for a in mine]
        for got, want in zip(seen, OFFSETS, strict=True):
            assert abs(got - want * 0.5) < TOLERANCE_S, (arm, seen)
        assert all(a["body"]["stream"] is True for a in mine)
    report = json.loads((out / "report.json").read_text())
    sent = [json.loads(line) for line in (out / "requests.jsonl").open()]
    responses = [s for s in sent if s["index"] % 2]
    assert all(s["success"] and s["ttft_s"] is not None for s in sent)
    assert [s["output_tokens"] for s in responses[:4]] == [5, 7, 9, 11]
    assert all(s["prompt_tokens"] == 4 for s in responses)  # input_tokens of response.completed
    assert report["config"]["endpoint"] == "chat,responses"
    assert {e["arm"] for e in report["comparison"]} == {"orca"}
    assert "replay of" in (out / "report.md").read_text()
