"""Server-Sent Events exactly as OpenAI frames them, in an endpoint's `StreamFormat`.

Chat and completions: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`, no `event:` lines; an
error raised after the 200 went out is sent in-band as `data: {"error": {...}}`, then
`data: [DONE]`. The Responses API: `event: <type>\\ndata: <json>\\n\\n` per payload (its
`type`), no `[DONE]`; an in-band error is an `error` event with the next `sequence_number`.
However the response ends (done, client gone mid-stream, or gone before the first byte),
the payload stream is closed, which aborts the engine request, and `on_end` reports the
outcome once.

`SSEResponse` is its own small ASGI response rather than sse-starlette's: one send per frame
and nothing around it (sse-starlette opens a timeout scope and looks up the async library on
every send, about a tenth of the event loop's work at 64 streams), a task that watches for
the client's disconnect, and keep-alive comments only when asked for.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import anyio
import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.context import CLIENT_CLOSED
from gateway.endpoint import OPENAI_CHUNKS, StreamFormat
from gateway.errors import APIError, server_error

log = structlog.get_logger("carousel.gateway")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"  # a comment line: clients skip it


OnEnd = Callable[[int, str | None], None]


class PayloadStream(AsyncIterator[str]):
    """Chunk payloads from `chunks`; `aclose()` runs `on_close` even if never iterated.

    (Closing an async generator that never started skips its `finally`; an engine request
    submitted before the first chunk would then run on for nobody.)
    """

    def __init__(self, chunks: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_close = on_close

    def __aiter__(self) -> PayloadStream:
        return self

    async def __anext__(self) -> str:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._on_close()


async def _aclose(payloads: object) -> None:
    aclose = getattr(payloads, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def sse_event(payload: str, event: str | None = None) -> bytes:
    data = b"data: " + payload.encode("utf-8") + b"\n\n"
    return data if event is None else b"event: " + event.encode("utf-8") + b"\n" + data


class _Framer:
    """Frames payloads in one `StreamFormat`, counting events for `sequence_number`."""

    def __init__(self, stream_format: StreamFormat) -> None:
        self.format = stream_format
        self.count = 0

    def frame(self, payload: str) -> bytes:
        self.count += 1
        if not self.format.event_lines:
            return sse_event(payload)
        return sse_event(payload, str(json.loads(payload).get("type", "message")))

    def error(self, exc: APIError) -> bytes:
        if not self.format.event_lines:
            return sse_event(json.dumps(exc.body()))
        error = exc.body()["error"]
        body = {
            "type": "error",
            "code": error["code"] or error["type"],
            "message": error["message"],
            "param": error["param"],
            "sequence_number": self.count,
        }
        return sse_event(json.dumps(body), "error")


async def sse_frames(
    payloads: AsyncIterator[str], on_end: OnEnd, stream_format: StreamFormat = OPENAI_CHUNKS
) -> AsyncIterator[bytes]:
    """Frame `payloads`; `on_end(status, error)` is called once however the stream ends."""
    status, error = 200, None
    framer = _Framer(stream_format)
    try:
        try:
            async for payload in payloads:
                yield framer.frame(payload)
        except APIError as exc:
            status, error = exc.status_code, exc.message
            yield framer.error(exc)
        except Exception as exc:  # never a traceback on the wire
            log.exception("stream_failed")
            status, error = 500, repr(exc)
            yield framer.error(server_error())
        if stream_format.done:
            yield DONE
    except BaseException:  # cancelled: the client went away mid-stream
        status, error = CLIENT_CLOSED, "client disconnected"
        raise
    finally:
        await _aclose(payloads)
        on_end(status, error)
        log.debug("stream_ended", status=status, events=framer.count)


class SSEResponse(StreamingResponse):
    """A streaming 200 whose body is `payloads` framed as SSE; a `: ping` comment every
    `ping_s` seconds while it is open (0: none)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        payloads: AsyncIterator[str],
        on_end: OnEnd,
        ping_s: float = 0.0,
        stream_format: StreamFormat = OPENAI_CHUNKS,
    ) -> None:
        super().__init__(
            sse_frames(payloads, on_end, stream_format),
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        self._payloads = payloads
        self._on_end = on_end
        self._ping_s = ping_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                if self._ping_s > 0:
                    send = _SerialSend(send)
                    tasks.start_soon(_ping, send, self._ping_s)
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})  # fmt: skip
                async for frame in self.body_iterator:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tasks.cancel_scope.cancel()  # the watcher and the pings
        finally:
            with anyio.CancelScope(shield=True):
                # NOTE: closing the frames reports a stream cut mid-way; both no-op once the
                # frames ran their own cleanup, and the payloads close even if never started
                await _aclose(self.body_iterator)
                await _aclose(self._payloads)
            self._on_end(CLIENT_CLOSED, "client disconnected before the stream started")


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel the response once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class _SerialSend:
    """`send` shared by the frames and the pings: one message at a time, none after the last."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = anyio.Lock()
        self._ended = False

    async def __call__(self, message: Message) -> None:
        async with self._lock:
            if self._ended:
                return
            self._ended = message["type"] == "http.response.body" and not message["more_body"]
            await self._send(message)


async def _ping(send: Send, every_s: float) -> None:
    while True:
        await anyio.sleep(every_s)
        await send({"type": "http.response.body", "body": PING, "more_body": True})
