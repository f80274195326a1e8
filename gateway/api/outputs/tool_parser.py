"""Parse `<tool_call>{"name": ..., "arguments": ...}</tool_call>` calls out of generated text.

One parser serves both paths, so they always agree: `ToolCallStreamParser.feed` takes text
as it is generated and returns what can already be sent (content text, and per call first a
header with its index, id and name, then fragments of its arguments, as OpenAI's
`delta.tool_calls` carry them); `parse_tool_calls` feeds a whole output at once.

- Text outside calls is content, stripped of leading and trailing whitespace; a partial
  `<tool_call>` at the end of a chunk is held back, never sent as content.
- `arguments` is the raw JSON text of the value the model wrote (the streamed fragments
  concatenate to exactly it).
- A call whose header (`{"name": "...", "arguments":`) never appears is given back as
  content, tags included (nothing the model wrote is dropped). A call cut short (length)
  keeps the arguments written so far.
Pure Python (no torch); the format is documented in docs/structured-outputs.md.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: `arguments` is a JSON text (as OpenAI's `function.arguments`)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """One entry of a chat `message.tool_calls`."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: `content` is None when the model only called tools."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its first carries `id` and `name` (arguments "")."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        """One entry of a chat chunk's `delta.tool_calls` (the header carries id, type and
        name; later pieces only the index and an arguments fragment)."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


StreamEvent = str | ToolCallDelta  # a str is a content delta


@dataclass
class _ValueScanner:
    """Finds where one JSON value ends, a character at a time."""

    started: bool = False
    done: bool = False
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    scalar: bool = False

    def take(self, text: str) -> int:
        """How many leading chars of `text` belong to the value (leading whitespace is
        skipped: it is counted but is not part of the value; see `skip`)."""
        for i, c in enumerate(text):
            if not self.started:
                self.started = True
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth = 1
                else:
                    self.scalar = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if self.scalar:
                if c in ",}] \t\r\n":
                    self.done = True
                    return i
                continue
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class _Call:
    """The call being parsed: its header once read, then its arguments."""

    body: str = ""  # text since `<tool_call>` while the header is not read yet
    index: int = 0
    id: str = ""
    name: str | None = None
    arguments: str = ""
    scanner: _ValueScanner = field(default_factory=_ValueScanner)
    tail: str = ""  # text after the arguments value, until `</tool_call>`


class ToolCallStreamParser:
    """Incremental parser: `feed(text)` then `finish()`; see the module docstring."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._text = ""  # unparsed text outside calls (a possible partial `<tool_call>`)
        self._call: _Call | None = None
        self._content_started = False
        self._held_space = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[StreamEvent]:
        """Parse newly generated `text`; return the events that are certain by now."""
        events: list[StreamEvent] = []
        self._text += text
        while self._text:
            if self._call is None:
                if not self._scan_text(events):
                    break
            elif not self._scan_call(events):
                break
        return events

    def finish(self) -> list[StreamEvent]:
        """The end of the output: flush what was held back."""
        events: list[StreamEvent] = []
        call = self._call
        if call is not None and call.name is None:
            self._emit_content(TOOL_CALL_BEGIN + call.body + self._text, events)
        elif call is not None:
            self._close(call)
        else:
            self._emit_content(self._text, events)
        self._call, self._text = None, ""
        return events

    def result(self) -> ParsedOutput:
        """The whole output parsed so far (after `finish`: the final answer)."""
        content = self.content or (None if self.tool_calls else "")
        return ParsedOutput(content, list(self.tool_calls))

    # -- outside calls ---------------------------------------------------------------------

    def _scan_text(self, events: list[StreamEvent]) -> bool:
        """Consume text outside a call; True when a call begins (more to scan)."""
        start = self._text.find(TOOL_CALL_BEGIN)
        if start >= 0:
            self._emit_content(self._text[:start], events)
            self._text = self._text[start + len(TOOL_CALL_BEGIN) :]
            self._call = _Call(index=len(self.tool_calls))
            return True
        keep = _partial_suffix(self._text, TOOL_CALL_BEGIN)
        self._emit_content(self._text[: len(self._text) - keep], events)
        self._text = self._text[len(self._text) - keep :]
        return False

    def _emit_content(self, text: str, events: list[StreamEvent]) -> None:
        """Send content, without leading or trailing whitespace of the whole output."""
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        text = self._held_space + text
        core = text.rstrip()
        self._held_space = text[len(core) :]
        if core:
            self.content += core
            events.append(core)

    # -- inside a call ---------------------------------------------------------------------

    def _scan_call(self, events: list[StreamEvent]) -> bool:
        """Consume text inside a call; True when the call ended (more to scan)."""
        call = self._call
        assert call is not None
        if call.name is None:
            return self._scan_header(call, events)
        if not call.scanner.done:
            text = self._text
            if not call.scanner.started:
                stripped = text.lstrip()
                if not stripped:
                    self._text = ""
                    return False
                text = stripped
            used = call.scanner.take(text)
            fragment, self._text = text[:used], text[used:]
            if fragment:
                call.arguments += fragment
                events.append(ToolCallDelta(call.index, arguments=fragment))
            if not call.scanner.done:
                return False
        call.tail += self._text
        self._text = ""
        end = call.tail.find(TOOL_CALL_END)
        if end < 0:
            return False
        self._text = call.tail[end + len(TOOL_CALL_END) :]
        self._close(call)
        return True

    def _scan_header(self, call: _Call, events: list[StreamEvent]) -> bool:
        call.body += self._text
        self._text = ""
        end = call.body.find(TOOL_CALL_END)
        # NOTE: the header is looked for only before `</tool_call>`, as a one-shot parse
        # sees it, so streamed and whole parses agree however the text is split
        match = _HEADER.match(call.body if end < 0 else call.body[:end])
        if match is not None:
            call.name = _unescape(match.group(1))
            call.id = self._new_id()
            events.append(ToolCallDelta(call.index, id=call.id, name=call.name))
            self._text = call.body[match.end() :]
            call.body = ""
            return True
        if end < 0:
            return False
        # no `{"name": ..., "arguments": ...}` header: a whole JSON body, or plain text
        body, self._text = call.body[:end], call.body[end + len(TOOL_CALL_END) :]
        parsed = _whole_call(body)
        if parsed is None:
            self._call = None
            self._emit_content(TOOL_CALL_BEGIN + body + TOOL_CALL_END, events)
            return True
        call.name, call.arguments, call.id = parsed[0], parsed[1], self._new_id()
        events.append(ToolCallDelta(call.index, id=call.id, name=call.name))
        events.append(ToolCallDelta(call.index, arguments=call.arguments))
        self._close(call)
        return True

    def _close(self, call: _Call) -> None:
        assert call.name is not None
        self.tool_calls.append(ToolCall(call.id, call.name, call.arguments))
        self._call = None


def chat_finish_reason(
    parsed_calls: bool, finish_reason: str | None, forced: bool = False
) -> str | None:
    """OpenAI's finish reason for a chat choice: `tool_calls` when the model stopped after
    calling tools, except that a call `tool_choice` named (`forced`) stops with `stop`, as
    OpenAI's does (a `length` cut stays `length`)."""
    return (
        "tool_calls" if parsed_calls and finish_reason == "stop" and not forced else finish_reason
    )


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> ParsedOutput:
    """Content and calls of a whole output (the same parser as streaming, fed once)."""
    parser = ToolCallStreamParser(new_id)
    parser.feed(text)
    parser.finish()
    return parser.result()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _unescape(name: str) -> str:
    try:
        return str(json.loads(f'"{name}"'))
    except ValueError:
        return name


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call body written in another key order, else None."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments
