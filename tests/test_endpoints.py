"""The endpoint table: each endpoint declared once, served by every arm through one method,
framed in its own stream format, and forwarded by upstream arms with no per-endpoint code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.upstream import UpstreamConfig
from gateway.api.endpoint import TYPED_EVENTS, Endpoint
from gateway.api.errors import APIError
from gateway.api.table import ENDPOINTS
from gateway.arms.upstream import UpstreamArm
from gateway.context import RequestContext
from gateway.http.sse import sse_frames
from gateway.services import RequestServices
from tests.conftest import SIM_MODEL, LiveServer, serve_app


async def _frames(payloads: list[str], fail: APIError | None = None) -> list[bytes]:
    async def source() -> AsyncIterator[str]:
        for payload in payloads:
            yield payload
        if fail is not None:
            raise fail

    ended: list[int] = []
    frames = sse_frames(source(), lambda status, _: ended.append(status), TYPED_EVENTS)
    out = [frame async for frame in frames]
    assert len(ended) == 1
    return out


def test_typed_event_streams_have_event_lines_and_no_done() -> None:
    payloads = [
        json.dumps({"type": "response.created", "sequence_number": 0}),
        json.dumps({"type": "response.output_text.delta", "sequence_number": 1, "delta": "hi"}),
    ]
    frames = asyncio.run(_frames(payloads, fail=APIError(500, "boom", "server_error")))
    assert frames[0] == b"event: response.created\ndata: " + payloads[0].encode() + b"\n\n"
    assert frames[1].startswith(b"event: response.output_text.delta\ndata: ")
    assert frames[2].startswith(b"event: error\ndata: ")
    error = json.loads(frames[2].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["message"] == "boom"
    assert error["sequence_number"] == 2
    assert not any(b"[DONE]" in frame for frame in frames)


def test_every_endpoint_of_the_table_is_routed_and_counted(server: LiveServer) -> None:
    bodies = {
        "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "completions": {"prompt": "hi", "max_tokens": 2},
        "responses": {"input": "hi", "max_output_tokens": 2},
    }
    for endpoint in ENDPOINTS:
        body = {"model": SIM_MODEL, **bodies[endpoint.name]}
        assert httpx.post(server.url + endpoint.path, json=body).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    for endpoint in ENDPOINTS:
        assert f'endpoint="{endpoint.name}"' in metrics


# -- an upstream arm forwards an endpoint it has no code for --------------------------------


class EchoRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False


async def _never(*_: object) -> Any:
    raise AssertionError("an upstream arm never runs the local pipeline")


ECHO = Endpoint("echo", "/v1/echo", EchoRequest, _never, TYPED_EVENTS, False)


async def _echo(request: Request) -> Response:
    body = await request.json()
    if not body.get("stream"):
        usage = {"input_tokens": 3, "output_tokens": 2}
        return JSONResponse({"object": "echo", "model": body["model"], "usage": usage})

    async def events() -> AsyncIterator[bytes]:
        kinds = [("response.created", {}), ("response.output_text.delta", {"delta": "hi"})]
        done = {"response": {"model": body["model"], "usage": {"input_tokens": 3,
                                                              "output_tokens": 1}}}  # fmt: skip
        kinds.append(("response.completed", done))
        for n, (kind, extra) in enumerate(kinds):
            data = json.dumps({"type": kind, "sequence_number": n, **extra})
            yield f"event: {kind}\ndata: {data}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def echo_upstream() -> Iterator[str]:
    app = Starlette(routes=[Route("/v1/echo", _echo, methods=["POST"])])
    with serve_app(app, ready_path=None) as url:  # type: ignore[arg-type]
        yield url


def _ctx(stream: bool) -> RequestContext:
    async def connected() -> bool:
        return False

    ctx = RequestContext("r1", "echo", "served-name", connected, stream=stream)
    ctx.raw_body = {"model": "served-name", "stream": stream, "x": 1}
    return ctx


async def _serve(url: str, stream: bool) -> tuple[Any, RequestContext]:
    arm = UpstreamArm("up", UpstreamConfig(base_urls=(f"{url}/v1",), model="upstream-model"))
    await arm.start()
    try:
        ctx = _ctx(stream)
        request = EchoRequest.model_validate(ctx.raw_body)
        reply = await arm.serve(ECHO, request, ctx, RequestServices())
        if stream:
            assert not isinstance(reply, dict)
            reply = [json.loads(p) async for p in reply]
        return reply, ctx
    finally:
        await arm.stop()


def test_upstream_arm_forwards_any_declared_endpoint(echo_upstream: str) -> None:
    reply, ctx = asyncio.run(_serve(echo_upstream, stream=False))
    assert reply == {
        "object": "echo",
        "model": "served-name",
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (3, 2)


def test_upstream_arm_streams_typed_events_through(echo_upstream: str) -> None:
    events, ctx = asyncio.run(_serve(echo_upstream, stream=True))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ]
    assert events[2]["response"]["model"] == "served-name"
    assert ctx.ttft_s is not None and (ctx.prompt_tokens, ctx.completion_tokens) == (3, 1)
