"""Incremental Server-Sent Events parsing for OpenAI-style streams.

Upstream bytes arrive in arbitrary slices: an event may be split across reads, several
may share one read, lines may end in ``\\n``, ``\\r\\n`` or ``\\r``. `SSEParser` turns them
into normalised frames ``b"data: <payload>\\n\\n"``, one per complete event, as soon as the
event's closing blank line arrives. Comments (``: ping``) and the ``event``/``id``/``retry``
fields are dropped; anything else is garbage and raises `SSEParseError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

DONE_FRAME = b"data: [DONE]\n\n"

_LINE_END = re.compile(rb"\r\n|\r|\n")
_IGNORED_FIELDS = frozenset({b"event", b"id", b"retry"})
_MAX_EVENT_BYTES = 8 * 1024 * 1024


class SSEParseError(ValueError):
    """The upstream stream is not a well-formed OpenAI SSE stream."""


class SSEParser:
    """Feed raw bytes with `feed`, then `close` at end of stream; both yield frames.

    NOTE: the iterators returned by `feed`/`close` must be consumed fully before the next
    call; they raise `SSEParseError` at the first malformed event, after yielding every
    good event that preceded it.
    """

    def __init__(self, max_event_bytes: int = _MAX_EVENT_BYTES) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """Add `chunk` and yield a frame for every event it completes."""
        self._buffer += chunk
        yield from self._drain(eof=False)

    def close(self) -> Iterator[bytes]:
        """End of stream: a final event missing only its blank line is still delivered."""
        yield from self._drain(eof=True)
        if self._buffer:
            yield from self._line(bytes(self._buffer))
            self._buffer.clear()
        yield from self._line(b"")

    def _drain(self, eof: bool) -> Iterator[bytes]:
        pos = 0
        for match in _LINE_END.finditer(self._buffer):
            if match.group() == b"\r" and match.end() == len(self._buffer) and not eof:
                break  # NOTE: may be the first half of a "\r\n" split across reads
            line = bytes(self._buffer[pos : match.start()])
            pos = match.end()
            yield from self._line(line)
        del self._buffer[:pos]
        if len(self._buffer) > self._max_event_bytes:
            raise SSEParseError("upstream sent an over-long line")

    def _line(self, line: bytes) -> Iterator[bytes]:
        if not line:
            yield from self._dispatch()
            return
        if line.startswith(b":"):
            return  # comment / keep-alive ping
        name, sep, value = line.partition(b":")
        if not sep:
            raise SSEParseError("upstream sent a line that is not an SSE field")
        if name == b"data":
            value = value[1:] if value.startswith(b" ") else value
            self._data.append(value)
            self._data_bytes += len(value)
            if self._data_bytes > self._max_event_bytes:
                raise SSEParseError("upstream sent an over-long event")
        elif name not in _IGNORED_FIELDS:
            raise SSEParseError("upstream sent an unknown SSE field")

    def _dispatch(self) -> Iterator[bytes]:
        lines, self._data, self._data_bytes = self._data, [], 0
        payload = b"\n".join(lines)
        if not payload.strip():
            return
        if payload.strip() == b"[DONE]":
            yield DONE_FRAME
            return
        check_payload(payload)
        yield b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def check_payload(payload: bytes) -> None:
    """Raise `SSEParseError` unless `payload` is a JSON object."""
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise SSEParseError("upstream sent an event that is not valid JSON") from None
    if not isinstance(value, dict):
        raise SSEParseError("upstream sent an event that is not a JSON object")
