"""The bench's streaming client: request bodies, SSE parsing and timing, errors, scheduling."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from bench.client import (
    ClientConfig,
    RequestResult,
    build_body,
    build_headers,
    run_requests,
    send_request,
)
from bench.workload import RequestSpec

CFG = ClientConfig(api_base="http://test/v1", model="m")
SPEC = RequestSpec(index=0, max_tokens=3, prompt="a b c", target_input_len=3)


def sse(*events: Any, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chat(content: str | None = None, role: bool = False, finish: str | None = None) -> dict:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}


async def send(
    handler: Callable[[httpx.Request], httpx.Response], cfg: ClientConfig = CFG, arm: str = "x"
) -> RequestResult:
    result = RequestResult(index=0, max_tokens=3)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await send_request(client, cfg, SPEC, arm, result, time.perf_counter())
    return result


def test_chat_body_streams_with_usage_and_ignore_eos() -> None:
    body = build_body(CFG, SPEC)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "a b c"}]
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["model"] == "m"
    completions = ClientConfig(api_base="x", model="m", endpoint="completions", ignore_eos=False)
    body = build_body(completions, SPEC)
    assert body["prompt"] == "a b c" and "messages" not in body and "ignore_eos" not in body


def test_the_bench_samples_at_its_temperature() -> None:
    assert build_body(CFG, SPEC)["temperature"] == 0.0
    sampled = ClientConfig(api_base="x", model="m", temperature=0.8)
    assert build_body(sampled, SPEC)["temperature"] == 0.8


def test_headers_carry_the_arm_and_the_key() -> None:
    keyed = ClientConfig(api_base="x", model="m", api_key="sk")
    assert build_headers(keyed, "orca")["X-Carousel-Arm"] == "orca"
    assert build_headers(keyed, None)["Authorization"] == "Bearer sk"
    assert "X-Carousel-Arm" not in build_headers(CFG, None)


async def test_role_chunk_is_not_the_first_token_and_usage_is_read() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = sse(chat(role=True), chat("a"), chat("b"), chat("c"), chat(finish="length"), USAGE)
        return httpx.Response(200, content=body)

    result = await send(handler)
    assert result.success and result.error is None
    assert seen[0].url.path == "/v1/chat/completions"
    assert seen[0].headers["x-carousel-arm"] == "x"
    assert result.num_chunks == 3 and len(result.itl) == 2
    assert result.output_tokens == 3 and result.prompt_tokens == 9
    assert result.ttft is not None and result.latency is not None
    assert 0 <= result.ttft <= result.latency


async def test_stream_without_usage_or_done_counts_content_chunks() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("x", "", "y")]
        return httpx.Response(200, content=sse(*chunks, done=False))

    cfg = ClientConfig(api_base="http://test/v1", model="m", endpoint="completions")
    result = await send(handler, cfg)
    assert result.success and result.output_tokens == 2 and result.prompt_tokens is None


async def test_http_error_status_fails_with_the_openai_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        error = {"message": "too long", "type": "invalid_request_error", "param": None}
        return httpx.Response(400, json={"error": {**error, "code": "context_length_exceeded"}})

    result = await send(handler)
    assert not result.success and result.error == "HTTP 400: too long"


async def test_in_stream_error_event_fails_the_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        error = {"error": {"message": "engine died", "type": "server_error"}}
        return httpx.Response(200, content=sse(chat(role=True), chat("a"), error))

    result = await send(handler)
    assert not result.success and result.error == "in-stream error: engine died"


async def test_transport_error_fails_the_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    result = await send(handler)
    assert not result.success and result.error is not None and "ConnectError" in result.error


class SlowStream(httpx.AsyncByteStream):
    """A chat stream that emits one content chunk every `gap` seconds."""

    def __init__(self, n: int, gap: float) -> None:
        self.n, self.gap = n, gap

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for _ in range(self.n):
            await asyncio.sleep(self.gap)
            yield sse(chat("t"), done=False)
        yield b"data: [DONE]\n\n"


def slow_handler(n: int, gap: float) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=SlowStream(n, gap))

    return handler


def use_transport(
    monkeypatch: pytest.MonkeyPatch, handler: Callable[[httpx.Request], httpx.Response]
) -> None:
    """Make run_requests' own AsyncClient talk to `handler`."""
    transport = httpx.MockTransport(handler)
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=transport, **kw))


async def test_timings_follow_the_stream() -> None:
    result = await send(slow_handler(4, 0.03))
    assert result.success and result.num_chunks == 4
    assert result.ttft is not None and result.ttft >= 0.025
    assert all(gap >= 0.02 for gap in result.itl) and len(result.itl) == 3
    assert result.latency is not None and result.latency >= 0.1


@pytest.mark.usefixtures("no_gc_pauses")
async def test_requests_go_out_on_schedule_and_stop_cancels_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_transport(monkeypatch, slow_handler(50, 0.02))  # 1 s per request
    specs = [RequestSpec(i, 50, prompt="p") for i in range(4)]
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.25, stop.set)
    outcome = await run_requests(CFG, specs, [0.0, 0.1, 0.2, 5.0], "a", stop)
    assert outcome.interrupted
    assert [r.index for r in outcome.results] == [0, 1, 2]  # the 4th was never sent
    assert all(r.cancelled and not r.success for r in outcome.results)
    sends = [r.send_time for r in outcome.results]
    assert sends[0] is not None and sends[0] < 0.05
    assert sends[1] is not None and 0.09 <= sends[1] < 0.2
    assert outcome.duration_s < 1.0


async def test_max_concurrency_limits_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    use_transport(monkeypatch, slow_handler(3, 0.02))  # about 60 ms per request
    cfg = ClientConfig(api_base="http://test/v1", model="m", max_concurrency=2)
    specs = [RequestSpec(i, 3, prompt="p") for i in range(6)]
    outcome = await run_requests(cfg, specs, [0.0] * 6, None, asyncio.Event())
    assert not outcome.interrupted
    assert all(r.success for r in outcome.results) and len(outcome.results) == 6
    events = []
    for r in outcome.results:
        assert r.send_time is not None and r.latency is not None
        events += [(r.send_time, 1), (r.send_time + r.latency, -1)]
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        running += delta
        peak = max(peak, running)
    assert peak == 2
    assert outcome.duration_s >= 3 * 0.06 * 0.9


async def test_timeout_bounds_the_whole_stream() -> None:
    cfg = ClientConfig(api_base="http://test/v1", model="m", timeout_s=0.05)
    result = await send(slow_handler(20, 0.02), cfg)  # 0.4 s of chunks, each 20 ms apart
    assert not result.success and result.error == "timed out after 0.05 s"


async def test_tool_call_fragments_count_as_generated_text() -> None:
    def call(args: str) -> dict:
        fn = {"index": 0, "function": {"arguments": args}}
        return {"choices": [{"index": 0, "delta": {"tool_calls": [fn]}}], "usage": None}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(chat(role=True), call('{"q"'), call(": 1}"), USAGE))

    result = await send(handler)
    assert result.success and result.ttft is not None and result.num_chunks == 2


def responses_event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def test_responses_stream_reads_typed_events_and_fails_on_response_failed() -> None:
    spec = RequestSpec(0, 3, body={"model": "m", "input": "hi"}, endpoint="responses")
    usage = {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
    events = {
        "ok": [
            responses_event("response.created", response={}),
            responses_event("response.output_text.delta", delta="a"),
            responses_event("response.output_text.delta", delta="b"),
            responses_event("response.completed", response={"usage": usage}),
        ],
        "failed": [
            responses_event("response.output_text.delta", delta="a"),
            responses_event("response.failed", response={"error": {"message": "oom"}}),
        ],
    }
    for name, stream in events.items():
        seen: list[httpx.Request] = []

        def handler(
            request: httpx.Request, stream: list[str] = stream, seen: list = seen
        ) -> httpx.Response:
            seen.append(request)
            return httpx.Response(200, content="".join(stream).encode())

        result = RequestResult(index=0, max_tokens=3)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await send_request(client, CFG, spec, None, result, time.perf_counter())
        assert seen[0].url.path == "/v1/responses"
        if name == "ok":
            assert result.success and result.num_chunks == 2 and len(result.itl) == 1
            assert (result.prompt_tokens, result.output_tokens) == (5, 2)
        else:
            assert not result.success and result.error == "in-stream error: oom"
