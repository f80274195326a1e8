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
from collections.abc import AsyncIterator, Callable

import anyio
import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.api.endpoint import OPENAI_CHUNKS, StreamFormat
from gateway.api.errors import APIError, server_error
from gateway.context import CLIENT_CLOSED

log = structlog.get_logger("carousel.gateway")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"  # a comment line: clients skip it


OnEnd = Callable[[int, str | None], None]


async def _aclose(payloads: object) -> None:
    aclose = getattr(payloads, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def sse_event(payload: str, event: str | None = None) -> bytes:
    data = b"data: " + payload.encode("utf-8") + b"\n\n"
    return data if event is None else b"event: " + event.encode("utf-8") + b"\n" + data


_SEQUENCED = '{"sequence_number":'
_TYPE_KEY = ',"type":"'


def event_type(payload: str) -> str:
    """A typed event's `type` ("message" without one).

    NOTE: the Responses events serialize their integer `sequence_number` and then their
    `type` first (protocol_responses._Event), so in that shape the type is read off the
    string: it runs per token, and parsing the whole event cost more than building it.
    Any other shape is parsed."""
    if payload.startswith(_SEQUENCED):
        key = payload.find(_TYPE_KEY, len(_SEQUENCED))
        number = payload[len(_SEQUENCED) : key]
        if key > 0 and number.isdigit():
            start = key + len(_TYPE_KEY)
            end = payload.find('"', start)
            if end > start and "\\" not in payload[start:end]:
                return payload[start:end]
    return str(json.loads(payload).get("type", "message"))


class _Framer:
    """Frames payloads in one `StreamFormat`, counting events for `sequence_number`."""

    def __init__(self, stream_format: StreamFormat) -> None:
        self.format = stream_format
        self.count = 0
        #: the last payload framed was one of the format's `closing_events`
        self.closing = False

    def frame(self, payload: str) -> bytes:
        self.count += 1
        if not self.format.event_lines:
            return sse_event(payload)
        event = event_type(payload)
        self.closing = event in self.format.closing_events
        return sse_event(payload, event)

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


def _nothing() -> None:
    pass


async def sse_frames(
    payloads: AsyncIterator[str],
    on_end: OnEnd,
    stream_format: StreamFormat = OPENAI_CHUNKS,
    on_closing: Callable[[], None] = _nothing,
) -> AsyncIterator[bytes]:
    """Frame `payloads`; `on_end(status, error)` is called once however the stream ends.

    `on_closing()` is called before the frame that closes the stream is yielded (`[DONE]`, an
    in-band error, a closing event), so that nothing goes out between it and the end of the
    body while the payloads clean up."""
    status, error = 200, None
    framer = _Framer(stream_format)
    try:
        try:
            async for payload in payloads:
                frame = framer.frame(payload)
                if framer.closing:
                    on_closing()
                yield frame
        except APIError as exc:
            status, error = exc.status_code, exc.message
            on_closing()
            yield framer.error(exc)
        except Exception as exc:  # never a traceback on the wire
            log.exception("stream_failed")
            status, error = 500, repr(exc)
            on_closing()
            yield framer.error(server_error())
        if stream_format.done:
            on_closing()
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
    `ping_s` seconds while it is open (0: none), never after the stream's closing frame."""

    media_type = "text/event-stream"

    def __init__(
        self,
        payloads: AsyncIterator[str],
        on_end: OnEnd,
        ping_s: float = 0.0,
        stream_format: StreamFormat = OPENAI_CHUNKS,
    ) -> None:
        self._keep_alive = _KeepAlive()
        super().__init__(
            sse_frames(payloads, on_end, stream_format, self._keep_alive.stop),
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
                    tasks.start_soon(self._keep_alive.pings, send, self._ping_s)
                    send = self._keep_alive.serial(send)
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})  # fmt: skip
                async for frame in self.body_iterator:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                self._keep_alive.stop()
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


class _KeepAlive:
    """`: ping` comments sharing `send` with the frames, one message at a time.

    `stop()` is called (synchronously, in the frames' task) before the closing frame is
    yielded; a ping that takes the lock after that is dropped, and one that took it before
    goes out ahead of the closing frame, which waits for the lock."""

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True

    def serial(self, send: Send) -> Send:
        async def serial_send(message: Message) -> None:
            async with self._lock:
                await send(message)

        return serial_send

    async def pings(self, send: Send, every_s: float) -> None:
        while not self._stopped:
            await anyio.sleep(every_s)
            async with self._lock:
                if self._stopped:
                    return
                await send({"type": "http.response.body", "body": PING, "more_body": True})
