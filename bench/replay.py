"""`carousel bench --replay FILE`: a traffic record (gateway/obs/traffic_record.py) as the workload.

The records are sorted by arrival (`t`, or `ts` when the files hold several recorder
sessions) and sent at their original offsets from the first, multiplied by `--time-scale`
(0.5 replays twice as fast). Each request keeps its own endpoint and body, so its parameters
(max_tokens, temperature, response_format, tools, ...) are the recorded ones; the replay only
turns streaming on (to time it), sets `model` when `--model` is given, and drops
`previous_response_id` (it names a response stored by the original server).

Redacted records are sent with synthetic text: each `{"redacted_chars": N}` becomes random
common words, the recorded `prompt_tokens` shared out in proportion to the characters (less an
estimate for the tools' schemas and the chat template), one word per token; a
`{"redacted_tokens": N}` prompt becomes N words. Their output is pinned to the recorded
`completion_tokens` (`max_tokens` or its endpoint's equivalent, `ignore_eos`, no `stop`), since
synthetic text cannot reproduce where the original answer ended; `--pin-lengths` pins every
record the same way, so every arm generates exactly what the original did.

This module reads the format; it imports nothing from the server (bench is a leaf).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from bench.workload import RequestSpec, synthetic_prompt

Endpoint = Literal["chat", "completions", "responses"]
PATH_ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "chat": "chat",
    "completions": "completions",
    "responses": "responses",
}
LENGTH_KEYS: dict[Endpoint, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
TEMPLATE_TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True)
class Recorded:
    """One line of a traffic record."""

    arrival: float  # seconds, for ordering and gaps (`t`, or `ts` across sessions)
    endpoint: Endpoint
    body: dict[str, Any]
    arm: str | None
    redacted: bool
    outcome: dict[str, Any]
    wall_time: float = 0.0  # `ts`: Unix time of the arrival
    model: str | None = None  # the served model


@dataclass
class ReplayWorkload:
    """The replay's requests and send times, and what the report says about it."""

    specs: list[RequestSpec]
    offsets: list[float]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def offered_rate(self) -> float:
        """Requests per second over the replay's span (inf when they all arrive at once)."""
        span = self.offsets[-1] if self.offsets else 0.0
        return (len(self.offsets) - 1) / span if span > 0 else math.inf


def load_records(paths: list[str | Path]) -> tuple[list[Recorded], Counter[str]]:
    """Every record of `paths`, in arrival order, and the reasons lines were skipped.

    A line that is not JSON raises ValueError naming it; a record of an endpoint the bench
    cannot send is skipped (and counted).
    """
    raw: list[tuple[str, float, float, dict[str, Any]]] = []
    skipped: Counter[str] = Counter()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
                        raise ValueError('each line must be an object with a "body" object')
                    t = float(obj["t"]) if obj.get("t") is not None else float(obj["ts"])
                    ts = float(obj["ts"]) if obj.get("ts") is not None else t
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: not a traffic record line: {exc}") from exc
                raw.append((str(obj.get("session")), t, ts, obj))
    by_wall = len({session for session, *_ in raw}) > 1
    raw.sort(key=lambda r: r[2] if by_wall else r[1])
    records = []
    for _, t, ts, obj in raw:
        endpoint = PATH_ENDPOINTS.get(str(obj.get("endpoint")))
        if endpoint is None:
            skipped[f"endpoint {obj.get('endpoint')}"] += 1
            continue
        records.append(
            Recorded(
                arrival=ts if by_wall else t,
                endpoint=endpoint,
                body=obj["body"],
                arm=obj.get("arm"),
                redacted=bool(obj.get("redacted")),
                outcome=obj.get("outcome") or {},
                wall_time=ts,
                model=obj.get("model"),
            )
        )
    return records, skipped


def replay_workload(
    records: list[Recorded],
    *,
    time_scale: float = 1.0,
    model: str | None = None,
    pin_lengths: bool = False,
    ignore_eos: bool = True,
    seed: int = 0,
) -> ReplayWorkload:
    """The requests to send and when (see the module docstring)."""
    rng = np.random.default_rng([seed, 5])
    start = records[0].arrival if records else 0.0
    specs, offsets = [], []
    pinned = 0
    for i, rec in enumerate(records):
        body = synthesize(rec, rng) if rec.redacted else json.loads(json.dumps(rec.body))
        body.pop("previous_response_id", None)
        if model:
            body["model"] = model
        if (pin_lengths or rec.redacted) and pin(body, rec, ignore_eos):
            pinned += 1
        specs.append(RequestSpec(i, _max_tokens(body, rec), body=body, endpoint=rec.endpoint))
        offsets.append(max(0.0, (rec.arrival - start) * time_scale))
    info = {
        "num_records": len(records),
        "time_scale": time_scale,
        "span_s": offsets[-1] if offsets else 0.0,
        "redacted": sum(r.redacted for r in records),
        "pinned": pinned,
        "endpoints": dict(Counter(r.endpoint for r in records)),
        "recorded_arms": dict(Counter(str(r.arm) for r in records)),
    }
    return ReplayWorkload(specs, offsets, info)


def pin(body: dict[str, Any], rec: Recorded, ignore_eos: bool) -> bool:
    """Fix the output to the recorded length; False when the record has none."""
    tokens = rec.outcome.get("completion_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        return False
    choices = body.get("n")
    n = choices if isinstance(choices, int) and choices > 0 else 1
    keys = LENGTH_KEYS[rec.endpoint]
    key = next((k for k in keys if k in body), keys[-1])
    body[key] = max(1, tokens // n)  # usage counts every choice
    body.pop("stop", None)
    if ignore_eos:
        body["ignore_eos"] = True
    return True


def _max_tokens(body: dict[str, Any], rec: Recorded) -> int:
    for key in LENGTH_KEYS[rec.endpoint]:
        if isinstance(body.get(key), int):
            return cast(int, body[key])
    tokens = rec.outcome.get("completion_tokens")
    return tokens if isinstance(tokens, int) else 0


def synthesize(rec: Recorded, rng: np.random.Generator) -> dict[str, Any]:
    """A redacted body with synthetic text of about the recorded prompt length."""
    markers: list[int] = []
    _collect(rec.body, markers)
    total_chars = sum(markers)
    recorded = rec.outcome.get("prompt_tokens")
    budget = recorded if isinstance(recorded, int) and recorded > 0 else total_chars // 4
    budget -= _kept_prompt_tokens(rec.body)
    budget = max(budget, len(markers))
    sizes = iter(max(1, round(budget * c / total_chars)) if total_chars else 1 for c in markers)
    return cast(dict[str, Any], _fill(rec.body, sizes, rng))


def _kept_prompt_tokens(body: dict[str, Any]) -> int:
    """A guess at the prompt tokens the record kept verbatim: tool schemas and the template."""
    schemas = [body.get(k) for k in ("tools", "functions") if body.get(k)]
    chars = len(json.dumps(schemas)) if schemas else 0
    messages = body.get("messages") or body.get("input")
    count = len(messages) if isinstance(messages, list) else 1
    return chars // 4 + TEMPLATE_TOKENS_PER_MESSAGE * count


def _is_marker(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and "redacted_chars" in value


def _collect(value: Any, markers: list[int]) -> None:
    if _is_marker(value):
        markers.append(int(value["redacted_chars"]))
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, markers)
    elif isinstance(value, list):
        for v in value:
            _collect(v, markers)


def _fill(value: Any, sizes: Any, rng: np.random.Generator) -> Any:
    if _is_marker(value):
        return synthetic_prompt(rng, next(sizes))
    if isinstance(value, dict) and set(value) == {"redacted_tokens"}:
        return synthetic_prompt(rng, max(1, int(value["redacted_tokens"])))
    if isinstance(value, dict):
        return {k: _fill(v, sizes, rng) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, sizes, rng) for v in value]
    return value
