"""The traffic record: one JSONL line per request, written off the request path.

`TrafficRecorder.record(entry)` only puts the entry on a bounded queue (never blocks, never
raises); a writer thread redacts, serialises and appends it, rotating the file by size. A full
queue drops the entry and counts it (`dropped_queue_full`); a write that fails (disk full,
unwritable path) counts the entries it lost (`write_failures`), logs once per episode, and the
writer retries the file a second later. `carousel bench --replay` reads these files.

A line (format version 1; docs/ab-testing.md has the full description)::

    {"v": 1, "session": "3f9c...", "t": 12.3456, "ts": 1767261600.123,
     "request_id": "chatcmpl-...", "endpoint": "/v1/chat/completions", "model": "smollm2",
     "arm": "orca", "redacted": false, "body": {...the JSON body as sent...},
     "outcome": {"status": 200, "finish_reason": "stop", "prompt_tokens": 12,
                 "completion_tokens": 30, "ttft_s": 0.12, "e2e_s": 1.2}}

`t` is the arrival in seconds after the recorder started (monotonic clock), `ts` the same
instant in Unix time. Lines are written when requests finish, so they are not in arrival
order. Headers are never recorded, and keys that may name credentials (any whose name
contains `key`, `token`, `secret`, `password` or `authorization`, other than the known
request parameters such as `max_tokens`) are removed from the body at any depth, redacted or
not. The file is created readable by its owner only (0600).

Redaction (`redact=True`) keeps the parameters and replaces every piece of text by its length:
a string becomes `{"redacted_chars": N}`, a prompt of token ids `{"redacted_tokens": N}`.
Kept verbatim: the sampling and length parameters, `stop`, and the `tools`, `functions`,
`response_format` and `text` schemas (they are the application's, not its users' text; they
shape the output and count in the prompt). Inside messages and inputs, the structure is kept
(`role`, `type`, ids, a function call's `name`); everything else that is a string is redacted,
and so is any top-level field not known as a parameter (`user`, `metadata`, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("carousel.traffic_record")

FORMAT_VERSION = 1
#: top-level body fields kept verbatim by redaction
PARAMETERS = frozenset(
    {
        "model", "max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens",
        "temperature", "top_p", "top_k", "min_p", "n", "best_of", "seed", "stream",
        "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "logprobs", "top_logprobs", "echo", "ignore_eos", "stop",
        "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "response_format", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "text", "reasoning",
        "truncation", "store", "service_tier", "include", "priority", "modalities",
        "previous_response_id",
    }
)  # fmt: skip
#: string fields kept inside messages and input items: structure, not content
STRUCTURE_KEYS = frozenset({"role", "type", "id", "tool_call_id", "call_id", "status"})
#: a key whose lower-cased name contains one of these is never recorded, at any depth
SECRET_PATTERNS = ("key", "token", "secret", "password", "authorization")
#: names that match a pattern but are request parameters or counts, not credentials
NOT_SECRET = PARAMETERS | {
    "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "reasoning_tokens",
}  # fmt: skip
_STOP = object()
_RETRY_S = 1.0
_BATCH = 512


@dataclass(frozen=True)
class TrafficEntry:
    """One finished request, as the request path hands it to `TrafficRecorder.record`.

    `arrival` is `time.monotonic()` when the request arrived (`RequestContext.start`);
    `endpoint` its path (`/v1/chat/completions`). NOTE: `body` is serialised later, on the
    writer thread: do not mutate it after `record()`.
    """

    arrival: float
    endpoint: str
    body: Mapping[str, Any]
    arm: str | None
    model: str | None = None
    request_id: str | None = None
    status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


def _is_secret(key: str) -> bool:
    name = key.lower()
    return name not in NOT_SECRET and any(pattern in name for pattern in SECRET_PATTERNS)


def scrub(value: Any) -> Any:
    """`value` without credential-named keys, at any depth (no other change)."""
    if isinstance(value, Mapping):
        return {k: scrub(v) for k, v in value.items() if not _is_secret(str(k))}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def redact(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body with parameters kept and all text replaced by lengths (module docstring)."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if _is_secret(str(key)):
            continue
        out[key] = scrub(value) if key in PARAMETERS else _redact_text(value)
    return out


def _redact_text(value: Any) -> Any:
    if isinstance(value, str):
        return {"redacted_chars": len(value)}
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return {"redacted_tokens": len(value)}  # a prompt of token ids
        return [_redact_text(v) for v in value]
    if isinstance(value, Mapping):
        call = "arguments" in value  # a function call: its name is the tool's, not text
        return {
            k: v if _is_structure(k, v, call) else _redact_text(v)
            for k, v in value.items()
            if not _is_secret(str(k))
        }
    return value  # numbers, booleans, null


def _is_structure(key: str, value: Any, in_call: bool) -> bool:
    return isinstance(value, str) and (key in STRUCTURE_KEYS or (in_call and key == "name"))


class TrafficRecorder:
    """Appends `TrafficEntry`s to a JSONL file from a writer thread (see the module docstring).

    `max_bytes` 0 never rotates; otherwise the file is renamed `PATH.1` (older ones shift to
    `PATH.2` ... `PATH.<backups>`, the oldest deleted) before a line would take it past
    `max_bytes`. A line is never split across files.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        redact: bool = False,
        max_bytes: int = 256 * 1024 * 1024,
        backups: int = 5,
        queue_size: int = 10_000,
    ) -> None:
        self.path = Path(path)
        self.redact = redact
        self.max_bytes = max_bytes
        self.backups = max(1, backups)
        self.session = uuid.uuid4().hex[:12]
        self.written = 0
        self.dropped_queue_full = 0
        self.write_failures = 0
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._file: Any = None
        self._size = 0
        self._retry_at = 0.0
        self._failing = False
        self._closed = False
        self._count_lock = threading.Lock()  # record() may run on several threads
        self._thread = threading.Thread(target=self._run, name="traffic-record", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Entries that never reached the file: queue full, or lost to a failed write."""
        return self.dropped_queue_full + self.write_failures

    def record(self, entry: TrafficEntry) -> None:
        """Queue `entry` for writing; never blocks and never raises (a full queue drops it)."""
        try:
            if self._closed:
                raise queue.Full
            self._queue.put_nowait(entry)
        except queue.Full:
            with self._count_lock:
                self.dropped_queue_full += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (within `timeout_s`), then stop the writer and close the file."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def line(self, entry: TrafficEntry) -> str:
        """The JSON line (no newline) for one entry."""
        body = redact(entry.body) if self.redact else scrub(dict(entry.body))
        t = entry.arrival - self._t0
        record = {
            "v": FORMAT_VERSION,
            "session": self.session,
            "t": round(t, 6),
            "ts": round(self._wall0 + t, 6),
            "request_id": entry.request_id,
            "endpoint": entry.endpoint,
            "model": entry.model,
            "arm": entry.arm,
            "redacted": self.redact,
            "body": body,
            "outcome": {
                "status": entry.status,
                "finish_reason": entry.finish_reason,
                "prompt_tokens": entry.prompt_tokens,
                "completion_tokens": entry.completion_tokens,
                "ttft_s": entry.ttft_s,
                "e2e_s": entry.e2e_s,
            },
        }
        return json.dumps(record, ensure_ascii=False, default=str, separators=(",", ":"))

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = any(item is _STOP for item in batch)
            entries = [item for item in batch if item is not _STOP]
            if entries:
                self._write(entries)
        self._close_file()

    def _write(self, entries: list[TrafficEntry]) -> None:
        lines = []
        for entry in entries:
            try:
                lines.append((self.line(entry) + "\n").encode("utf-8"))
            except Exception as exc:  # a body that cannot be serialised: lose it, not the writer
                self._fail(1, exc)
        if not lines:
            return
        try:
            self._append(lines)
        except OSError as exc:
            self._close_file()
            self._retry_at = time.monotonic() + _RETRY_S
            self._fail(len(lines), exc)
            return
        self.written += len(lines)
        if self._failing:
            self._failing = False
            log.info("traffic record writable again", path=str(self.path), lost=self.dropped)

    def _append(self, lines: list[bytes]) -> None:
        if self._file is None:
            if time.monotonic() < self._retry_at:
                raise OSError("the traffic record failed recently; retrying in a moment")
            self._open()
        for data in lines:
            if self.max_bytes and self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._size += len(data)
        self._file.flush()

    def _open(self) -> None:
        # NOTE: created 0600 (prompts and outputs are private); an existing file is narrowed
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # not ours, or not a regular file (/dev/full)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, 0o600)
        self._file = os.fdopen(fd, "ab")
        try:
            self._size = os.fstat(self._file.fileno()).st_size
        except OSError:
            self._size = 0

    def _rotate(self) -> None:
        self._file.flush()
        if not self.path.is_file():  # /dev/full, a pipe: nothing to rotate
            return
        self._close_file()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def _close_file(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        with contextlib.suppress(OSError):
            file.close()

    def _fail(self, count: int, exc: Exception) -> None:
        self.write_failures += count
        if not self._failing:
            self._failing = True
            log.warning(
                "traffic record write failed; records are being dropped",
                path=str(self.path),
                error=f"{type(exc).__name__}: {exc}",
            )
