"""Keep-alive `: ping` comments go out between events, never after the closing frame.

The response is driven as a bare ASGI app with a payload source that is slow to end and slow
to close, the window in which a loaded server once let a ping out after `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json

import anyio
from starlette.types import Message

from gateway.api.endpoint import OPENAI_CHUNKS, TYPED_EVENTS, StreamFormat
from gateway.http.sse import DONE, PING, SSEResponse

PING_S = 0.005


class _SlowPayloads:
    """`payloads` with a gap before each; ending and closing each take `slow_s`."""

    def __init__(self, payloads: list[str], gap_s: float, slow_s: float) -> None:
        self._left = list(payloads)
        self._gap_s = gap_s
        self._slow_s = slow_s

    def __aiter__(self) -> _SlowPayloads:
        return self

    async def __anext__(self) -> str:
        if not self._left:
            await anyio.sleep(self._slow_s)
            raise StopAsyncIteration
        await anyio.sleep(self._gap_s)
        return self._left.pop(0)

    async def aclose(self) -> None:
        await anyio.sleep(self._slow_s)


async def _bodies(payloads: _SlowPayloads, stream_format: StreamFormat) -> list[bytes]:
    sent: list[Message] = []

    async def receive() -> Message:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    response = SSEResponse(payloads, lambda status, error: None, PING_S, stream_format)
    await response({"type": "http"}, receive, send)
    assert sent[0]["type"] == "http.response.start"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    return [message["body"] for message in sent[1:-1]]


def _after(bodies: list[bytes], closing: bytes) -> list[bytes]:
    return bodies[bodies.index(closing) + 1 :]


def test_no_ping_after_done_while_the_payloads_close() -> None:
    payloads = _SlowPayloads(['{"n": 1}', '{"n": 2}'], gap_s=10 * PING_S, slow_s=20 * PING_S)
    bodies = asyncio.run(_bodies(payloads, OPENAI_CHUNKS))
    assert bodies.count(PING) >= 2, bodies  # pings do go out while tokens are slow
    assert bodies[-1] == DONE and bodies.count(DONE) == 1, bodies


def test_no_ping_after_a_closing_event_while_the_source_ends() -> None:
    created = json.dumps({"type": "response.created", "sequence_number": 0})
    completed = json.dumps({"type": "response.completed", "sequence_number": 1})
    payloads = _SlowPayloads([created, completed], gap_s=10 * PING_S, slow_s=20 * PING_S)
    bodies = asyncio.run(_bodies(payloads, TYPED_EVENTS))
    closing = b"event: response.completed\ndata: " + completed.encode() + b"\n\n"
    assert bodies.count(PING) >= 2, bodies
    assert _after(bodies, closing) == [], bodies
