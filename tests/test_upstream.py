"""Upstream arms against real uvicorn servers on loopback running fake OpenAI-like apps.

One fake server hosts every behaviour under ``/{tag}/v1/...``; the tag's part before the
first ``_`` picks the behaviour (``ok_a`` and ``ok_b`` are two distinct healthy replicas).
Request-body fields ``x_chunks``/``x_delay``/``x_sleep`` steer the fake; the proxy forwards
them untouched, which doubles as a check that bodies pass through.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from structlog.testing import capture_logs

from backends.upstream import (
    DONE_FRAME,
    SSEParseError,
    SSEParser,
    UpstreamClient,
    UpstreamConfig,
    UpstreamError,
)
from backends.upstream.errors import error_from_client_error

API_KEY = "sk-test-SECRET-key-123"
UPSTREAM_MODEL = "upstream-model"
CHAT = "/chat/completions"


# ----------------------------------------------------------------------------- fake server


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeUpstream:
    """An OpenAI-like app whose behaviour is chosen per tag; records what it saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self._aborted: dict[str, threading.Event] = {}

    def reset(self) -> None:
        with self._lock:
            self.hits.clear()
            self.requests.clear()
            self._aborted.clear()

    def aborted(self, tag: str) -> threading.Event:
        """Set when the response for `tag` was cut short by the client going away."""
        with self._lock:
            return self._aborted.setdefault(tag, threading.Event())

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/{tag}/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/{tag}/v1/completions", self.completions, methods=["POST"]),
                Route("/{tag}/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def models(self, request: Request) -> Response:
        behaviour = request.path_params["tag"].split("_")[0]
        if behaviour == "nomodels":
            return Response(status_code=404)
        if behaviour == "sick":
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
        return JSONResponse({"object": "list", "data": [{"id": UPSTREAM_MODEL}]})

    async def health(self, request: Request) -> Response:
        return Response()

    async def completions(self, request: Request) -> Response:
        tag = request.path_params["tag"]
        behaviour = tag.split("_")[0]
        body = await request.json()
        with self._lock:
            self.hits[tag] += 1
            self.requests.append((tag, body, dict(request.headers)))
        if behaviour == "fail500":
            error = {"message": "Traceback (most recent call last): boom", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=500)
        if behaviour == "badrequest":
            error = {
                "message": "prompt is too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            return JSONResponse({"error": error}, status_code=400)
        if behaviour == "unauthorized":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if behaviour == "garbage":
            return Response("<html>oops</html>", media_type="text/html")
        if behaviour == "slow":
            await asyncio.sleep(body.get("x_sleep", 1.0))
        if behaviour == "slowpoll":
            return await self._slow_polling(tag, request, body.get("x_sleep", 2.0))
        if not body.get("stream"):
            await asyncio.sleep(body.get("x_delay", 0.0))
            return JSONResponse(self._completion(body, request))
        return StreamingResponse(self._events(behaviour, tag, body), media_type="text/event-stream")

    def _completion(self, body: dict[str, Any], request: Request) -> dict[str, Any]:
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
            "x_seen": {
                "authorization": request.headers.get("authorization"),
                "x_request_id": request.headers.get("x-request-id"),
                "has_stream": "stream" in body,
                "has_stream_options": "stream_options" in body,
            },
        }

    async def _slow_polling(self, tag: str, request: Request, seconds: float) -> Response:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.aborted(tag).set()
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        return JSONResponse({"object": "chat.completion", "choices": []})

    async def _events(self, behaviour: str, tag: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        model = body["model"]
        finished = False
        try:
            if behaviour == "ragged":
                async for piece in _ragged(model):
                    yield piece
                finished = True
                return
            yield _chunk(model, {"role": "assistant", "content": ""})
            if behaviour == "stall":
                await asyncio.sleep(body.get("x_sleep", 1.0))
            if behaviour == "garbagemid":
                yield b"data: {not json\n\n"
            for i in range(body.get("x_chunks", 3)):
                await asyncio.sleep(body.get("x_delay", 0.0))
                yield _chunk(model, {"content": f"tok{i}"})
                if behaviour == "midclose":
                    raise RuntimeError("replica crashed mid-stream")
            yield _chunk(model, {}, finish="stop")
            if behaviour != "nodone":
                yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.aborted(tag).set()


async def _ragged(model: str) -> AsyncIterator[bytes]:
    """CRLF line ends, comments, an `event:` field, events split across 5-byte writes."""
    one = _chunk(model, {"role": "assistant", "content": ""}).replace(b"\n", b"\r\n")
    two = _chunk(model, {"content": "tok0"})
    text = b": ping\r\n\r\n" + one + b"event: message\n" + two + b"data: [DONE]\r\n\r\n"
    for start in range(0, len(text), 5):
        yield text[start : start + 5]
        await asyncio.sleep(0.002)


class ServerThread:
    """A uvicorn server on an already-bound socket, run in a daemon thread."""

    def __init__(self, app: Starlette, sock: socket.socket) -> None:
        config = uvicorn.Config(
            app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake upstream did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def _bound_socket() -> socket.socket:
    """A loopback socket bound to a free port but not listening: connections are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _url(sock: socket.socket, tag: str) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}/{tag}/v1"


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[FakeUpstream, socket.socket]]:
    fake = FakeUpstream()
    sock = _bound_socket()
    server = ServerThread(fake.app(), sock)
    server.start()
    yield fake, sock
    server.stop()
    sock.close()


@pytest.fixture
def fake(fake_server: tuple[FakeUpstream, socket.socket]) -> FakeUpstream:
    fake_server[0].reset()
    return fake_server[0]


@pytest.fixture
def url(fake_server: tuple[FakeUpstream, socket.socket]) -> Callable[[str], str]:
    return lambda tag: _url(fake_server[1], tag)


@pytest.fixture
def dead_url() -> Iterator[Callable[[], str]]:
    socks: list[socket.socket] = []

    def make() -> str:
        socks.append(_bound_socket())
        return _url(socks[-1], "ok")

    yield make
    for sock in socks:
        sock.close()


MakeClient = Callable[..., Awaitable[UpstreamClient]]


@pytest.fixture
async def client() -> AsyncIterator[MakeClient]:
    made: list[UpstreamClient] = []

    async def make(*base_urls: str, **overrides: Any) -> UpstreamClient:
        settings: dict[str, Any] = {
            "api_key": API_KEY,
            "connect_timeout_s": 1.0,
            "read_timeout_s": 5.0,
            "health_interval_s": 0.0,
        }
        settings.update(overrides)
        upstream = UpstreamClient(UpstreamConfig(base_urls, UPSTREAM_MODEL, **settings))
        await upstream.start()
        made.append(upstream)
        return upstream

    yield make
    for upstream in made:
        await upstream.close()


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "served-name", "messages": [{"role": "user", "content": "hi"}], **extra}


async def _collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [frame async for frame in stream]


def _payload(frame: bytes) -> Any:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n"), frame
    return json.loads(frame[len(b"data: ") : -2])


def _contents(frames: list[bytes]) -> list[str]:
    out = []
    for frame in frames:
        if frame == DONE_FRAME or "error" in _payload(frame):
            continue
        out.append(_payload(frame)["choices"][0]["delta"].get("content", ""))
    return out


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------- SSE parser

RAW_EVENTS = (
    b": keep-alive\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b'data:{"b": 2}\n\n'
    b'event: message\nid: 7\r\ndata: {"c":\r\ndata:  3}\r\n\r\n'
    b'data: {"d": 4}\r\rdata: [DONE]\n\n'
)
EXPECTED_FRAMES = [
    b'data: {"a": 1}\n\n',
    b'data: {"b": 2}\n\n',
    b'data: {"c":\ndata:  3}\n\n',
    b'data: {"d": 4}\n\n',
    DONE_FRAME,
]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, len(RAW_EVENTS)])
def test_sse_parser_frames_do_not_depend_on_how_bytes_are_split(piece: int) -> None:
    parser = SSEParser()
    frames: list[bytes] = []
    for start in range(0, len(RAW_EVENTS), piece):
        frames.extend(parser.feed(RAW_EVENTS[start : start + piece]))
    frames.extend(parser.close())
    assert frames == EXPECTED_FRAMES


def test_sse_parser_emits_an_event_as_soon_as_its_blank_line_arrives() -> None:
    parser = SSEParser()
    assert list(parser.feed(b'data: {"a": 1}\n')) == []
    assert list(parser.feed(b"\n")) == [b'data: {"a": 1}\n\n']


def test_sse_parser_delivers_a_final_event_missing_its_blank_line_at_eof() -> None:
    parser = SSEParser()
    assert list(parser.feed(b'data: {"a": 1}\n\ndata: {"b": 2}')) == [b'data: {"a": 1}\n\n']
    assert list(parser.close()) == [b'data: {"b": 2}\n\n']


@pytest.mark.parametrize("garbage", [b"data: {not json\n\n", b"<html>\n\n", b"data: [1]\n\n"])
def test_sse_parser_yields_good_events_then_rejects_garbage(garbage: bytes) -> None:
    parser = SSEParser()
    frames: list[bytes] = []
    with pytest.raises(SSEParseError):
        for frame in parser.feed(b'data: {"a": 1}\n\n' + garbage):
            frames.append(frame)
    assert frames == [b'data: {"a": 1}\n\n']


# ----------------------------------------------------------------------------- error mapping


def test_flat_and_fastapi_4xx_bodies_are_wrapped_in_openai_shape() -> None:
    detail = {"detail": [{"loc": ["body", "max_tokens"], "msg": "must be positive"}]}
    err = error_from_client_error(422, json.dumps(detail).encode())
    assert err.to_dict() == {
        "error": {
            "message": "max_tokens: must be positive",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    flat = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    err = error_from_client_error(400, json.dumps(flat).encode())
    assert (err.status, err.message, err.type, err.code) == (400, "bad", "BadRequestError", None)
    err = error_from_client_error(429, b"<html>slow down</html>")
    assert (err.status, err.type) == (429, "rate_limit_error")
    assert err.message == "upstream returned HTTP 429"


# ----------------------------------------------------------------------------- streaming


@pytest.mark.usefixtures("no_gc_pauses")
async def test_stream_is_forwarded_incrementally_not_buffered(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ok"))
    start = time.monotonic()
    arrivals: list[float] = []
    frames: list[bytes] = []
    async for frame in upstream.stream(CHAT, _body(x_chunks=3, x_delay=0.5)):
        arrivals.append(time.monotonic() - start)
        frames.append(frame)
    assert arrivals[0] < 0.4, arrivals  # the upstream sends its first event at once...
    assert arrivals[-1] - arrivals[0] > 1.3, arrivals  # ...and its last after 3 x 0.5 s
    assert _contents(frames) == ["", "tok0", "tok1", "tok2", ""]
    assert all(_payload(f)["model"] == UPSTREAM_MODEL for f in frames[:-1])
    assert frames[-1] == DONE_FRAME and frames.count(DONE_FRAME) == 1
    ((_, seen_body, _),) = fake.requests
    assert seen_body["model"] == UPSTREAM_MODEL and seen_body["stream"] is True


async def test_ragged_crlf_stream_with_pings_is_normalised(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ragged"))
    frames = await _collect(upstream.stream(CHAT, _body()))
    assert _contents(frames) == ["", "tok0"]
    assert all(f.endswith(b"\n\n") and b"\r" not in f for f in frames)
    assert frames[-1] == DONE_FRAME and frames.count(DONE_FRAME) == 1


async def test_missing_done_is_appended_exactly_once(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("nodone"))
    frames = await _collect(upstream.stream(CHAT, _body(x_chunks=2)))
    assert _contents(frames) == ["", "tok0", "tok1", ""]
    assert frames[-1] == DONE_FRAME and frames.count(DONE_FRAME) == 1


async def test_mid_stream_close_ends_with_inband_error_then_done(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("midclose"))
    frames = await _collect(upstream.stream(CHAT, _body()))
    assert _contents(frames[:2]) == ["", "tok0"]
    error = _payload(frames[2])["error"]
    assert error["code"] == "upstream_bad_response" and error["type"] == "server_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert frames[3:] == [DONE_FRAME]


async def test_garbage_mid_stream_ends_with_inband_error_then_done(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("garbagemid"))
    frames = await _collect(upstream.stream(CHAT, _body()))
    assert len(frames) == 3
    assert _payload(frames[1])["error"]["code"] == "upstream_bad_response"
    assert frames[2] == DONE_FRAME


async def test_stalled_stream_ends_with_inband_timeout_then_done(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("stall"), read_timeout_s=0.3)
    frames = await _collect(upstream.stream(CHAT, _body(x_sleep=1.5)))
    assert len(frames) == 3
    assert _payload(frames[1])["error"]["code"] == "upstream_timeout"
    assert frames[2] == DONE_FRAME


async def test_aclose_closes_the_upstream_stream_promptly(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ok_close"))
    stream = upstream.stream(CHAT, _body(x_chunks=50, x_delay=0.1))
    assert _contents([await anext(stream), await anext(stream)]) == ["", "tok0"]
    assert upstream.replicas[0].outstanding == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert upstream.replicas[0].outstanding == 0
    assert await asyncio.to_thread(fake.aborted("ok_close").wait, 2.0)


async def test_cancelling_the_consumer_closes_the_upstream_stream(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ok_cancel"))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in upstream.stream(CHAT, _body(x_chunks=50, x_delay=0.1)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.aborted("ok_cancel").wait, 2.0)
    assert upstream.replicas[0].outstanding == 0


# ----------------------------------------------------------------------------- non-streaming


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
async def test_complete_returns_upstream_json_with_model_rewritten_and_headers_forwarded(
    path: str, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ok"))
    body = _body(stream=True, stream_options={"include_usage": True})
    headers = {"x-request-id": "req-42", "Authorization": "Bearer client-key"}
    status, data = await upstream.complete(path, body, headers=headers)
    assert status == 200
    assert data["model"] == UPSTREAM_MODEL
    assert data["x_seen"] == {
        "authorization": f"Bearer {API_KEY}",
        "x_request_id": "req-42",
        "has_stream": False,
        "has_stream_options": False,
    }
    assert body["model"] == "served-name"  # the caller's dict is not mutated


async def test_cancelling_complete_closes_the_upstream_request(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("slowpoll_cancel"))
    task = asyncio.create_task(upstream.complete(CHAT, _body(x_sleep=3.0)))
    await _wait_for(lambda: fake.hits["slowpoll_cancel"] == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.aborted("slowpoll_cancel").wait, 2.0)
    assert upstream.replicas[0].outstanding == 0


async def test_garbage_body_is_502_bad_response(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("garbage"))
    with pytest.raises(UpstreamError) as info:
        await upstream.complete(CHAT, _body())
    assert (info.value.status, info.value.code) == (502, "upstream_bad_response")
    stream = upstream.stream(CHAT, _body())
    with pytest.raises(UpstreamError) as info:
        await anext(stream)
    assert (info.value.status, info.value.code) == (502, "upstream_bad_response")


async def test_slow_upstream_is_504_timeout(url: Callable[[str], str], client: MakeClient) -> None:
    upstream = await client(url("slow"), read_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(UpstreamError) as info:
        await upstream.complete(CHAT, _body(x_sleep=1.5))
    assert time.monotonic() - start < 1.2
    assert (info.value.status, info.value.code) == (504, "upstream_timeout")
    assert info.value.type == "server_error"
    assert upstream.replicas[0].healthy  # a slow generation says nothing about health


async def test_upstream_4xx_is_passed_through_and_never_retried(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("badrequest"), url("ok"))
    with pytest.raises(UpstreamError) as info:
        await upstream.complete(CHAT, _body())
    assert info.value.status == 400
    assert info.value.to_dict() == {
        "error": {
            "message": "prompt is too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert fake.hits == Counter({"badrequest": 1})
    assert upstream.replicas[0].healthy


async def test_upstream_401_is_reported_as_the_gateways_problem(
    url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("unauthorized"))
    stream = upstream.stream(CHAT, _body())
    with pytest.raises(UpstreamError) as info:
        await anext(stream)
    assert (info.value.status, info.value.code) == (502, "upstream_auth_failed")


# ----------------------------------------------------------------------------- replicas


@pytest.mark.parametrize("streaming", [False, True])
async def test_dead_replica_fails_over_and_is_marked_unhealthy(
    streaming: bool,
    url: Callable[[str], str],
    dead_url: Callable[[], str],
    client: MakeClient,
) -> None:
    upstream = await client(dead_url(), url("ok"))
    if streaming:
        frames = await _collect(upstream.stream(CHAT, _body()))
        assert _contents(frames)[:2] == ["", "tok0"]
    else:
        assert (await upstream.complete(CHAT, _body()))[0] == 200
    dead, alive = upstream.replicas
    assert (dead.healthy, dead.failures, dead.outstanding) == (False, 1, 0)
    assert (alive.healthy, alive.failures, alive.outstanding) == (True, 0, 0)


@pytest.mark.parametrize("streaming", [False, True])
async def test_5xx_before_first_byte_is_retried_on_another_replica(
    streaming: bool, fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("fail500"), url("ok"))
    if streaming:
        frames = await _collect(upstream.stream(CHAT, _body()))
        assert frames[-1] == DONE_FRAME and len(frames) == 6
    else:
        assert (await upstream.complete(CHAT, _body()))[0] == 200
    assert fake.hits == Counter({"fail500": 1, "ok": 1})
    assert not upstream.replicas[0].healthy


async def test_retries_bound_the_replicas_tried(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("fail500"), url("ok"), retries=0)
    with pytest.raises(UpstreamError) as info:
        await upstream.complete(CHAT, _body())
    assert info.value.status == 502
    assert fake.hits == Counter({"fail500": 1})


async def test_all_replicas_unreachable_is_503_upstream_unavailable(
    dead_url: Callable[[], str], client: MakeClient
) -> None:
    upstream = await client(dead_url(), dead_url())
    for call in (upstream.complete(CHAT, _body()), anext(upstream.stream(CHAT, _body()))):
        with pytest.raises(UpstreamError) as info:
            await call
        err = info.value.to_dict()["error"]
        assert info.value.status == 503
        assert err["type"] == "server_error" and err["code"] == "upstream_unavailable"
        assert set(err) == {"message", "type", "param", "code"}
        assert "127.0.0.1" not in err["message"] and API_KEY not in err["message"]
    assert [r.healthy for r in upstream.replicas] == [False, False]


async def test_all_replicas_failing_with_5xx_is_502_without_upstream_traceback(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("fail500_a"), url("fail500_b"))
    with pytest.raises(UpstreamError) as info:
        await upstream.complete(CHAT, _body())
    assert (info.value.status, info.value.code) == (502, "upstream_unavailable")
    assert "Traceback" not in info.value.message and "boom" not in info.value.message
    assert fake.hits == Counter({"fail500_a": 1, "fail500_b": 1})


async def test_requests_go_to_the_replica_with_fewest_outstanding(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("ok_a"), url("ok_b"))
    held = upstream.stream(CHAT, _body(x_chunks=50, x_delay=0.1))
    await anext(held)  # one long stream in flight on ok_a
    for _ in range(3):  # round robin alone would send one of these to ok_a
        await upstream.complete(CHAT, _body())
    assert fake.hits == Counter({"ok_a": 1, "ok_b": 3})
    await held.aclose()  # type: ignore[attr-defined]

    fake.reset()
    await asyncio.gather(*(upstream.complete(CHAT, _body(x_delay=0.3)) for _ in range(4)))
    assert fake.hits == Counter({"ok_a": 2, "ok_b": 2})
    assert [r.outstanding for r in upstream.replicas] == [0, 0]


async def test_health_check_takes_down_and_restores_a_replica(
    fake: FakeUpstream, url: Callable[[str], str], client: MakeClient
) -> None:
    sock = _bound_socket()  # refuses connections until a server listens on it
    try:
        upstream = await client(_url(sock, "ok_back"), url("ok"), health_interval_s=0.1)
        await _wait_for(lambda: not upstream.replicas[0].healthy)
        server = ServerThread(fake.app(), sock)
        server.start()
        try:
            await _wait_for(lambda: upstream.replicas[0].healthy)
            assert upstream.replicas[0].failures == 0
            await upstream.complete(CHAT, _body())
            await upstream.complete(CHAT, _body())
            assert fake.hits["ok_back"] == 1
        finally:
            server.stop()
    finally:
        sock.close()


async def test_health_probe_uses_models_then_falls_back_to_root_health(
    dead_url: Callable[[], str], url: Callable[[str], str], client: MakeClient
) -> None:
    upstream = await client(url("sick"), url("nomodels"), dead_url(), url("ok"))
    await upstream.check_health()
    assert [r.healthy for r in upstream.replicas] == [False, True, False, True]


async def test_secrets_stay_out_of_logs_urls_and_reprs(
    url: Callable[[str], str], dead_url: Callable[[], str], client: MakeClient
) -> None:
    dead = dead_url().replace("http://", "http://user:hunter2@") + "?key=qsecret"
    upstream = await client(dead, url("fail500"))
    with capture_logs() as logs, pytest.raises(UpstreamError):
        await upstream.complete(CHAT, _body())
    assert logs, "replica failures should be logged"
    text = repr(logs) + repr(upstream.replicas) + repr(upstream.config)
    for secret in (API_KEY, "hunter2", "qsecret"):
        assert secret not in text
