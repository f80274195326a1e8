"""The traffic recorder: the line format, redaction, rotation, and failures that never reach
the caller (a full disk, an unwritable path, a full queue)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.obs.traffic_record import TrafficEntry, TrafficRecorder, redact

SECRET_WORDS = ["zebrafish", "quokka", "marmalade", "axolotl", "tangerine", "pangolin",
                "narwhal", "kumquat", "okapi", "wombat", "capybara", "ocelot"]  # fmt: skip


def chat_body() -> dict[str, Any]:
    """A chat body with one secret word in every place text can hide."""
    w = SECRET_WORDS
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"you are {w[0]}"},
            {"role": "user", "name": w[1], "content": [{"type": "text", "text": f"hi {w[2]}"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"q": w[3]})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": f"found {w[4]}"},
        ],
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["\n\n"],
        "user": w[5],
        "metadata": {"team": w[6]},
        "api_key": "sk-live-123",
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}},
    }


def entry(body: dict[str, Any], arrival: float | None = None, **outcome: Any) -> TrafficEntry:
    return TrafficEntry(
        arrival=time.monotonic() if arrival is None else arrival,
        endpoint="/v1/chat/completions",
        body=body,
        arm="orca",
        model="m",
        request_id="req-1",
        status=200,
        finish_reason="stop",
        prompt_tokens=40,
        completion_tokens=7,
        ttft_s=0.05,
        e2e_s=0.2,
        **outcome,
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_holds_arrival_endpoint_body_arm_and_outcome(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    recorder = TrafficRecorder(path)
    t0 = time.monotonic()
    recorder.record(entry(chat_body(), arrival=t0 + 1.5))
    recorder.close()
    (line,) = lines(path)
    assert line["v"] == 1 and line["endpoint"] == "/v1/chat/completions" and line["arm"] == "orca"
    assert 1.4 < line["t"] < 1.6 and abs(line["ts"] - (time.time() + 1.5)) < 2
    assert line["redacted"] is False and line["body"]["messages"] == chat_body()["messages"]
    assert line["outcome"] == {
        "status": 200, "finish_reason": "stop", "prompt_tokens": 40, "completion_tokens": 7,
        "ttft_s": 0.05, "e2e_s": 0.2,
    }  # fmt: skip
    assert "api_key" not in line["body"] and "sk-live" not in path.read_text()
    assert recorder.written == 1 and recorder.dropped == 0


def test_redaction_leaves_no_text_only_lengths_and_parameters(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    recorder = TrafficRecorder(path, redact=True)
    recorder.record(entry(chat_body()))
    completion = {"model": "m", "prompt": [f"tell {SECRET_WORDS[7]}", "x"], "max_tokens": 3}
    recorder.record(entry(completion))
    recorder.record(entry({"model": "m", "prompt": [101, 102, 103]}))
    responses = {
        "model": "m",
        "instructions": f"be {SECRET_WORDS[8]}",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": SECRET_WORDS[9]}]},
            {"type": "function_call_output", "call_id": "c1", "output": SECRET_WORDS[10]},
        ],
        "max_output_tokens": 9,
        "text": {"format": {"type": "json_object"}},
    }
    recorder.record(entry(responses))
    recorder.record(entry({"model": "m", "input": f"plain {SECRET_WORDS[11]}"}))
    recorder.close()
    text = path.read_text()
    for word in [*SECRET_WORDS, "sk-live"]:
        assert word not in text, word
    chat, comp, ids, resp, plain = lines(path)
    assert all(line["redacted"] is True for line in (chat, comp, ids, resp, plain))
    body = chat["body"]
    assert (body["max_tokens"], body["temperature"], body["stop"]) == (7, 0.5, ["\n\n"])
    assert body["tools"] == chat_body()["tools"]  # schemas are parameters
    assert body["response_format"] == chat_body()["response_format"]
    system, user, assistant, tool = body["messages"]
    assert system == {"role": "system", "content": {"redacted_chars": len("you are zebrafish")}}
    assert user["name"] == {"redacted_chars": len("quokka")}
    assert user["content"] == [{"type": "text", "text": {"redacted_chars": len("hi marmalade")}}]
    call = assistant["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"]["name"] == "lookup"
    assert call["function"]["arguments"] == {"redacted_chars": len('{"q": "axolotl"}')}
    assert tool["tool_call_id"] == "call_1" and assistant["content"] is None
    assert body["user"] == {"redacted_chars": len("pangolin")}
    assert body["metadata"] == {"team": {"redacted_chars": len("narwhal")}}
    assert comp["body"]["prompt"] == [
        {"redacted_chars": len("tell kumquat")},
        {"redacted_chars": 1},
    ]
    assert ids["body"]["prompt"] == {"redacted_tokens": 3}
    output = {"redacted_chars": len("capybara")}
    assert resp["body"]["input"][1] == {
        "type": "function_call_output",
        "call_id": "c1",
        "output": output,
    }
    assert resp["body"]["text"] == responses["text"] and resp["body"]["max_output_tokens"] == 9
    assert plain["body"]["input"] == {"redacted_chars": len("plain ocelot")}


def test_redact_is_a_pure_function_of_the_body() -> None:
    body = chat_body()
    before = json.dumps(body)
    redact(body)
    assert json.dumps(body) == before  # the caller's body is untouched


def test_the_file_rotates_by_size_without_splitting_lines(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    recorder = TrafficRecorder(path, max_bytes=4000, backups=3)
    size = len(recorder.line(entry(chat_body()))) + 1
    for i in range(60):
        recorder.record(entry({**chat_body(), "seed": i}))
    recorder.close()
    files = [path, *(path.with_name(f"traffic.jsonl.{i}") for i in (1, 2, 3))]
    assert all(f.exists() for f in files) and not path.with_name("traffic.jsonl.4").exists()
    assert all(f.stat().st_size <= 4000 for f in files)
    per_file = 4000 // size
    seeds = [[line["body"]["seed"] for line in lines(f)] for f in files]
    assert [len(s) for s in seeds[:3]] == [60 % per_file or per_file, per_file, per_file]
    assert seeds[0][-1] == 59  # newest in PATH, older in PATH.1, PATH.2 ...
    assert seeds[1][-1] == seeds[0][0] - 1 and seeds[2][-1] == seeds[1][0] - 1
    assert recorder.written == 60 and recorder.dropped == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_never_raises_and_counts_what_it_lost() -> None:
    recorder = TrafficRecorder("/dev/full", max_bytes=100)
    for _ in range(20):
        recorder.record(entry(chat_body()))  # must not raise
    recorder.close()
    assert recorder.written == 0 and recorder.dropped == 20 and recorder.write_failures == 20


def test_an_unwritable_path_never_raises_and_counts_drops(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    recorder = TrafficRecorder(blocker / "traffic.jsonl")  # open() fails: NotADirectoryError
    for _ in range(5):
        recorder.record(entry(chat_body()))
    recorder.close()
    assert recorder.written == 0 and recorder.dropped == 5


@pytest.mark.usefixtures("no_gc_pauses")
def test_a_full_queue_drops_without_blocking_the_caller(tmp_path: Path) -> None:
    recorder = TrafficRecorder(tmp_path / "traffic.jsonl", queue_size=4)
    release = threading.Event()
    real_write = recorder._write

    def stuck_write(entries: list[TrafficEntry]) -> None:  # a disk that hangs
        release.wait(10)
        real_write(entries)

    recorder._write = stuck_write  # type: ignore[method-assign]
    recorder.record(entry(chat_body()))  # the writer takes this one and hangs on it
    time.sleep(0.1)
    start = time.perf_counter()
    for _ in range(200):
        recorder.record(entry(chat_body()))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5  # 200 calls; a blocking put would hang until the release
    assert recorder.dropped_queue_full == 200 - 4
    release.set()
    recorder.close()
    assert recorder.written == 5 and recorder.dropped == 196
    recorder.record(entry(chat_body()))  # after close: counted, not raised
    assert recorder.dropped == 197
