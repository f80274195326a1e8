"""Server-Sent Events exactly as OpenAI frames them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`.

No `event:` or `id:` lines. An error raised after the 200 went out is sent in-band as a
`data: {"error": {...}}` event followed by `data: [DONE]`. However the response ends (done,
client gone mid-stream, or gone before the first byte), the payload stream is closed, which
aborts the engine request, and `on_end` reports the outcome once.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import structlog
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from gateway.context import CLIENT_CLOSED
from gateway.errors import APIError, server_error

log = structlog.get_logger("carousel.gateway")

DONE = b"data: [DONE]\n\n"


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


async def _aclose(payloads: AsyncIterator[str]) -> None:
    aclose = getattr(payloads, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8") + b"\n\n"


async def sse_frames(payloads: AsyncIterator[str], on_end: OnEnd) -> AsyncIterator[bytes]:
    """Frame `payloads`; `on_end(status, error)` is called once however the stream ends."""
    status, error = 200, None
    try:
        try:
            async for payload in payloads:
                yield sse_event(payload)
        except APIError as exc:
            status, error = exc.status_code, exc.message
            yield sse_event(_error_json(exc))
        except Exception as exc:  # never a traceback on the wire
            log.exception("stream_failed")
            status, error = 500, repr(exc)
            yield sse_event(_error_json(server_error()))
        yield DONE
    except BaseException:  # cancelled: the client went away mid-stream
        status, error = CLIENT_CLOSED, "client disconnected"
        raise
    finally:
        await _aclose(payloads)
        on_end(status, error)


def _error_json(exc: APIError) -> str:
    return json.dumps(exc.body())


class SSEResponse(EventSourceResponse):
    """A streaming 200 whose body is `payloads` framed as SSE (`ping_s=0`: no comments)."""

    def __init__(self, payloads: AsyncIterator[str], on_end: OnEnd, ping_s: float = 0.0) -> None:
        super().__init__(sse_frames(payloads, on_end), ping=ping_s, sep="\n")
        self._payloads = payloads
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # NOTE: no-ops when sse_frames already ran its own cleanup
            await _aclose(self._payloads)
            self._on_end(CLIENT_CLOSED, "client disconnected before the stream started")
