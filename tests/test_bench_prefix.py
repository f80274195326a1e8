"""The bench's prefix-sharing workloads: a shared system prompt, multi-turn conversations, and
the cache hit rate in the report (against a live server with caching on in one arm only)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cli import main
from bench.client import ClientConfig, RequestResult, run_requests
from bench.metrics import prefix_cache_summary
from bench.workload import (
    add_shared_prefix,
    build_conversations,
    build_workload,
    num_arrivals,
    parse_dist,
    spread_offsets,
)
from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import serve_app
from tests.test_bench_client import use_transport

CFG = ClientConfig(api_base="http://test/v1", model="m")


def test_every_conversation_starts_with_the_same_system_prompt() -> None:
    specs = build_workload(5, parse_dist("8", "input"), parse_dist("2", "output"), seed=3)
    shared = add_shared_prefix(specs, 12, seed=3)
    systems = [s.as_messages()[0] for s in shared]
    assert all(m == systems[0] and m["role"] == "system" for m in systems)
    assert len(systems[0]["content"].split()) == 12
    assert [s.as_messages()[1]["content"] for s in shared] == [s.prompt for s in specs]
    assert all(s.target_input_len == 20 for s in shared)
    assert shared[0].as_prompt().startswith(systems[0]["content"] + "\n")  # completions too
    assert len({s.as_messages()[1]["content"] for s in shared}) == 5  # the questions differ


def test_conversations_have_their_turns_in_order() -> None:
    specs = build_conversations(3, 4, parse_dist("5", "input"), parse_dist("2", "output"), 1)
    assert [(s.conversation, s.turn) for s in specs[:5]] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1)]
    assert len(specs) == 12 and num_arrivals(specs) == 3
    shared = add_shared_prefix(specs, 4, seed=1)
    assert [s.as_messages()[0]["role"] for s in shared[:2]] == ["system", "user"]
    offsets = spread_offsets(specs, [0.0, 1.5, 2.5])
    assert offsets == [0.0] * 4 + [1.5] * 4 + [2.5] * 4


async def test_each_turn_goes_after_the_previous_answer_with_the_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        seen.append(messages)
        answer = f"answer {len(messages)}"
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
        events = [
            {"choices": [{"index": 0, "delta": {"content": answer}}]},
            {"choices": [], "usage": usage},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    use_transport(monkeypatch, handler)
    specs = add_shared_prefix(
        build_conversations(2, 3, parse_dist("3", "input"), parse_dist("1", "output"), 0), 2, 0
    )
    outcome = await run_requests(
        CFG, specs, spread_offsets(specs, [0.0, 0.05]), None, asyncio.Event()
    )
    results = sorted(outcome.results, key=lambda r: r.index)
    assert all(r.success for r in results) and [r.turn for r in results] == [1, 2, 3] * 2
    third = next(m for m in seen if len(m) == 6)  # system, user, answer, user, answer, user
    assert [m["role"] for m in third] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert [m["content"] for m in third if m["role"] == "assistant"] == ["answer 2", "answer 4"]
    assert third[-1]["content"] == specs[2].as_messages()[0]["content"]
    for before, after in zip(results, results[1:], strict=False):
        if after.turn != 1:  # sent once the previous turn's stream had ended
            assert after.send_time >= before.send_time + before.latency  # type: ignore[operator]
    summary = prefix_cache_summary(results)
    assert summary["hit_rate"] == pytest.approx(0.4) and summary["cached_tokens"] == 24
    assert summary["ttft_ms_later_turns"]["p50"] is not None


async def test_a_failed_turn_ends_its_conversation(monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if len(json.loads(request.content)["messages"]) > 1:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, content=b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')

    use_transport(monkeypatch, handler)
    specs = build_conversations(1, 4, parse_dist("3", "input"), parse_dist("1", "output"), 0)
    outcome = await run_requests(CFG, specs, [0.0] * 4, None, asyncio.Event())
    assert [(r.turn, r.success) for r in outcome.results] == [(1, True), (2, False)]


def test_hit_rate_is_unknown_when_the_server_does_not_say() -> None:
    result = RequestResult(0, 1, prompt_tokens=10, success=True)
    assert prefix_cache_summary([result])["hit_rate"] is None


def test_the_report_shows_the_hit_rate_of_each_arm(tmp_path: Path) -> None:
    arms = [
        {"name": "on", "enable_prefix_caching": True},
        {"name": "off", "enable_prefix_caching": False},
    ]
    settings = Settings(backend="sim", served_model_name="sim", arms=arms)  # type: ignore[arg-type]
    with serve_app(create_app(settings)) as url:
        code = main(
            [
                "--url", url, "--model", "sim", "--arm", "on", "--arm", "off",
                "--num-requests", "3", "--multi-turn", "3", "--shared-prefix-len", "40",
                "--input-len", "6", "--output-len", "4", "--rate", "inf", "--warmups", "0",
                "--out", str(tmp_path), "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["multi_turn"] == 3 and report["config"]["shared_prefix_len"] == 40
    by_arm = {run["arm"]: run for run in report["runs"]}
    assert by_arm["on"]["metrics"]["completed"] == by_arm["off"]["metrics"]["completed"] == 9
    assert by_arm["on"]["prefix_cache"]["hit_rate"] > 0.5
    assert by_arm["off"]["prefix_cache"]["hit_rate"] == 0
    markdown = (tmp_path / "report.md").read_text()
    assert "## Prefix cache" in markdown and "cache hit rate" in markdown
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert {line["turn"] for line in lines} == {1, 2, 3}
    assert all(line["cached_tokens"] is not None for line in lines)
