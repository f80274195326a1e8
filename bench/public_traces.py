"""Public LLM serving traces as a bench workload: what each row asks for and when.

Formats (`--replay-format`, or found from the file's content):

- `azure`: the Azure LLM inference traces (AzurePublicDataset, 2023 and 2024): CSV with
  `TIMESTAMP` (a date-time), `ContextTokens`, `GeneratedTokens`.
- `burstgpt`: BurstGPT's CSV: `Timestamp` (seconds), `Model`, `Request tokens`,
  `Response tokens`, `Total tokens`, `Log Type`. Rows with 0 response tokens are the trace's
  failures; they are kept (asking for 1 token), since they were part of the load.
- `mooncake`: Mooncake's JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`
  (one id per 512-token block; a shared id is a shared prefix).
- `sharegpt`: a JSON list of `{"conversations": [{"from": "human"|"gpt", "value": ...}]}`:
  prompt text (the first human turn) and an output length (the reply's words), no times
  (arrivals then come from `--rate`).
- `carousel`: Carousel's own traffic record (bench/replay.py), told apart by its `body`.

Every row becomes a `TraceRequest`; arrivals are seconds after the first row, so `--time-scale`
and a start offset apply the same way to every format.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TraceFormat = Literal["carousel", "azure", "burstgpt", "mooncake", "sharegpt"]
FORMATS: tuple[str, ...] = ("auto", "carousel", "azure", "burstgpt", "mooncake", "sharegpt")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True)
class TraceRequest:
    """One row of a public trace: when (None: no time) and how long, in tokens."""

    arrival_s: float | None
    input_len: int | None
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    prompt: str | None = None  # ShareGPT: the prompt text itself


def detect_format(path: str | Path) -> TraceFormat:
    """The format of `path` from its first line; ValueError naming what was expected."""
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(4096)
    first = head.lstrip().splitlines()[0] if head.strip() else ""
    columns = {c.strip() for c in first.split(",")}
    if set(AZURE_COLUMNS) <= columns:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= columns:
        return "burstgpt"
    if first.startswith("["):
        return "sharegpt"
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and "body" in obj:
            return "carousel"
        if isinstance(obj, dict) and {"input_length", "output_length"} <= set(obj):
            return "mooncake"
    raise ValueError(
        f"{path}: not a trace the bench knows (a Carousel traffic record, an Azure LLM "
        "inference CSV, a BurstGPT CSV, a Mooncake JSONL or ShareGPT JSON); name it with "
        "--replay-format"
    )


def load_trace(path: str | Path, fmt: TraceFormat) -> list[TraceRequest]:
    """The rows of a public trace (not `carousel`: bench/replay.py reads that), in file order
    sorted by arrival; ValueError naming the line that does not parse."""
    readers = {"azure": _azure, "burstgpt": _burstgpt, "mooncake": _mooncake}
    if fmt == "sharegpt":
        rows = _sharegpt(path)
    else:
        rows = []
        for lineno, row in readers[fmt](path):
            try:
                rows.append(row())
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a {fmt} trace row: {exc!r}") from exc
    if not rows:
        raise ValueError(f"{path}: no requests in the {fmt} trace")
    times = [r.arrival_s for r in rows if r.arrival_s is not None]
    if not times:
        return rows
    start = min(times)
    shifted = [
        TraceRequest(r.arrival_s - start, r.input_len, r.output_len, r.hash_ids, r.prompt)
        if r.arrival_s is not None
        else r
        for r in rows
    ]
    return sorted(shifted, key=lambda r: r.arrival_s or 0.0)


def _csv_rows(path: str | Path) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        for row in reader:
            if any(v for v in row.values()):
                yield reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items()}


def _tokens(text: str, least: int = 0) -> int:
    value = int(float(text))
    if value < least:
        raise ValueError(f"a token count below {least}: {text!r}")
    return value


def _azure(path: str | Path) -> Iterator[tuple[int, Any]]:
    for lineno, row in _csv_rows(path):

        def parse(row: dict[str, str] = row) -> TraceRequest:
            when = dt.datetime.fromisoformat(row["TIMESTAMP"]).timestamp()
            return TraceRequest(
                when, _tokens(row["ContextTokens"], 1), max(_tokens(row["GeneratedTokens"]), 1)
            )

        yield lineno, parse


def _burstgpt(path: str | Path) -> Iterator[tuple[int, Any]]:
    for lineno, row in _csv_rows(path):

        def parse(row: dict[str, str] = row) -> TraceRequest:
            return TraceRequest(
                float(row["Timestamp"]),
                _tokens(row["Request tokens"], 1),
                max(_tokens(row["Response tokens"]), 1),
            )

        yield lineno, parse


def _mooncake(path: str | Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue

            def parse(line: str = line) -> TraceRequest:
                obj = json.loads(line)
                ids = obj.get("hash_ids")
                if ids is not None and not all(isinstance(i, int) for i in ids):
                    raise ValueError("hash_ids must be integers")
                return TraceRequest(
                    float(obj["timestamp"]) / 1000.0,
                    _tokens(str(obj["input_length"]), 1),
                    max(_tokens(str(obj["output_length"])), 1),
                    tuple(ids) if ids is not None else None,
                )

            yield lineno, parse


def _sharegpt(path: str | Path) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path}: not ShareGPT JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT JSON is a list of conversations")
    rows = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        human = next((t for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if human is None or not isinstance(human.get("value"), str) or not human["value"]:
            continue
        after = turns[turns.index(human) + 1 :]
        reply = next((t for t in after if isinstance(t, dict) and t.get("from") == "gpt"), None)
        words = len(str(reply.get("value", "")).split()) if reply else 0
        rows.append(TraceRequest(None, None, max(words, 1), prompt=human["value"]))
    return rows
