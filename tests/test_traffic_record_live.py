"""`--record-traffic` on a live server: one line per request with its outcome, redaction,
no credentials, a full disk never failing a request, and replay of what was recorded."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.cli import main as bench_main
from tests.conftest import CHAT, SIM_MODEL, LiveServer

SECRET = "sk-live-secret-key"
PROMPT = "the private words of a user"


def lines_of(path: Path, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        found = [json.loads(line) for line in text.splitlines()]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} of {count} lines recorded"
        time.sleep(0.05)


@pytest.mark.usefixtures("no_gc_pauses")
def test_each_request_is_one_line_with_its_arm_outcome_and_arrival(
    make_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    path = tmp_path / "traffic.jsonl"
    srv = make_server(record_traffic=str(path), api_keys=[SECRET])
    client = openai.OpenAI(base_url=srv.v1, api_key=SECRET, max_retries=0)
    sent = []
    for gap in [0.0, 0.2, 0.3]:
        time.sleep(gap)
        sent.append(time.time())
        client.chat.completions.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3
        )
    stream = client.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=2, stream=True)
    assert len(list(stream)) >= 1
    records = sorted(lines_of(path, 4), key=lambda r: r["t"])
    assert [r["endpoint"] for r in records] == ["/v1/chat/completions"] * 3 + ["/v1/completions"]
    assert {r["arm"] for r in records} == {srv.arm.name}
    first = records[0]
    assert first["body"]["messages"][0]["content"] == PROMPT
    assert first["outcome"]["status"] == 200
    assert first["outcome"]["finish_reason"] == "length"
    assert first["outcome"]["completion_tokens"] == 3 and first["outcome"]["prompt_tokens"] > 0
    assert first["outcome"]["ttft_s"] is not None and first["outcome"]["e2e_s"] > 0
    # the arrivals are as far apart as the client sent them (each gap also holds the previous
    # request's own latency, so the client's clock is the reference, not the sleeps)
    offsets = [b["t"] - a["t"] for a, b in zip(records, records[1:3], strict=False)]
    client_offsets = [b - a for a, b in zip(sent, sent[1:], strict=False)]
    for seen, gap in zip(offsets, client_offsets, strict=True):
        assert abs(seen - gap) < 0.05, (seen, gap)
    assert SECRET not in path.read_text()
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert "carousel_traffic_record_written_total 4.0" in metrics


def test_redacted_records_keep_lengths_and_parameters_not_text(
    make_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    path = tmp_path / "traffic.jsonl"
    srv = make_server(record_traffic=str(path), record_redact=True)
    body = {**CHAT, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.5}
    assert httpx.post(f"{srv.v1}/chat/completions", json=body).status_code == 200
    [record] = lines_of(path, 1)
    text = path.read_text()
    assert PROMPT not in text and "private" not in text
    assert record["redacted"] is True and record["body"]["temperature"] == 0.5
    assert record["body"]["messages"][0]["content"] == {"redacted_chars": len(PROMPT)}


def test_an_unwritable_record_never_fails_a_request(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(record_traffic="/dev/full")
    for _ in range(3):
        assert httpx.post(f"{srv.v1}/chat/completions", json=CHAT).status_code == 200

    def dropped() -> float:
        for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
            if line.startswith("carousel_traffic_record_dropped_total"):
                return float(line.split()[-1])
        return 0.0

    deadline = time.monotonic() + 10
    while dropped() < 3:
        assert time.monotonic() < deadline, "the lost lines were not counted"
        time.sleep(0.1)


@pytest.mark.usefixtures("no_gc_pauses")
def test_a_recorded_session_replays_with_its_arrivals(
    make_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    recorded = tmp_path / "recorded.jsonl"
    source = make_server(record_traffic=str(recorded))
    gaps = [0.0, 0.15, 0.4, 0.05]
    for i, gap in enumerate(gaps):
        time.sleep(gap)
        body = {**CHAT, "max_tokens": 2 + i}
        assert httpx.post(f"{source.v1}/chat/completions", json=body).status_code == 200
    lines_of(recorded, len(gaps))
    replayed = tmp_path / "replayed.jsonl"
    target = make_server(record_traffic=str(replayed))
    argv = ["--url", target.url, "--model", SIM_MODEL, "--replay", str(recorded),
            "--out", str(tmp_path / "out"), "--no-progress", "--warmups", "0",
            "--no-trace"]  # fmt: skip
    assert bench_main(argv) == 0
    want = sorted(r["t"] for r in lines_of(recorded, len(gaps)))
    # the bench's probe (max_tokens 1, sent before the run) is recorded too: leave it out
    lines = [r for r in lines_of(replayed, len(gaps) + 1) if r["body"]["max_tokens"] > 1]
    seen = sorted(r["t"] for r in lines)
    for w, s in zip(want, seen, strict=True):
        assert abs((s - seen[0]) - (w - want[0])) < 0.05, (want, seen)
    tokens = sorted(r["body"]["max_tokens"] for r in lines)
    assert tokens == [2, 3, 4, 5]
