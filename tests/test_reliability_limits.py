"""Request limits: each is an OpenAI-shaped 400/413 naming the param, checked before the
engine sees the request; and a flood of huge prompts leaves memory bounded."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.pipeline import ServingOptions
from gateway.api.protocol import ChatCompletionRequest
from gateway.arms.engine_factory import scheduler_config, serving_options
from gateway.settings.load import Settings
from tests.conftest import CHAT, SIM_MODEL, LiveServer, error_of, sim_arm

HELLO = CHAT["messages"]
COMPLETION = {"model": SIM_MODEL, "prompt": "Hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("patch", "param", "words"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": "x" * 257}, "stop", "256 characters"),
        ({"stop": ["ok", "y" * 300]}, "stop", "256 characters"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"n": 129}, "n", "128"),
        ({"n": 0}, "n", "1"),
        ({"messages": HELLO * 2049}, "messages", "2048"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "256"),
        ({"max_tokens": 10**9}, "max_tokens", "too large"),
        ({"max_completion_tokens": 10**12}, "max_completion_tokens", "too large"),
        ({"max_tokens": 0}, "max_tokens", "1"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "20"),
    ],
)
def test_chat_limits_are_400_naming_the_param(
    server: LiveServer, patch: dict[str, Any], param: str, words: str
) -> None:
    response = httpx.post(f"{server.v1}/chat/completions", json={**CHAT, **patch})
    error = error_of(response, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


@pytest.mark.parametrize(
    ("patch", "param", "words"),
    [
        ({"prompt": ["p"] * 2049}, "prompt", "at most 2048 prompts"),
        ({"prompt": [[65]] * 2049}, "prompt", "at most 2048 prompts"),
        ({"prompt": ["p"] * 20, "n": 128}, "n", "2560 choices"),
        ({"prompt": ["p"] * 2048, "n": 2}, "n", "4096 choices"),
        ({"max_tokens": 2**40}, "max_tokens", "too large"),
        ({"logprobs": 6}, "logprobs", "5"),
        ({"stop": ["1", "2", "3", "4", "5"]}, "stop", "at most 4"),
    ],
)
def test_completion_limits_are_400_naming_the_param(
    server: LiveServer, patch: dict[str, Any], param: str, words: str
) -> None:
    response = httpx.post(f"{server.v1}/completions", json={**COMPLETION, **patch})
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"]


def test_limits_at_their_bounds_are_accepted(server: LiveServer) -> None:
    body = {**CHAT, "stop": ["a" * 256, "b", "c", "d"], "n": 128, "max_tokens": 1}
    assert httpx.post(f"{server.v1}/chat/completions", json=body).status_code == 200
    many = {**COMPLETION, "prompt": ["p"] * 2048, "max_tokens": 1}
    reply = httpx.post(f"{server.v1}/completions", json=many, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2048
    bias = {str(i): 0.0 for i in range(300)}  # the sim vocabulary is smaller: parse only
    assert len(ChatCompletionRequest.model_validate({**CHAT, "logit_bias": bias}).logit_bias or {})


def test_prompt_over_max_prompt_tokens_is_context_length_exceeded(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(sim_arm(options=ServingOptions(max_prompt_tokens=100)))
    over = {**COMPLETION, "prompt": "a" * 101}
    error = error_of(httpx.post(f"{srv.v1}/completions", json=over), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "at most 100 prompt tokens" in error["message"] and "101" in error["message"]
    chat = {**CHAT, "messages": [{"role": "user", "content": "b" * 120}]}
    error = error_of(httpx.post(f"{srv.v1}/chat/completions", json=chat), 400)
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    fits = {**COMPLETION, "prompt": "a" * 100}
    assert httpx.post(f"{srv.v1}/completions", json=fits).status_code == 200
    assert srv.arm.engine.scheduler.has_work is False


def test_oversized_bodies_are_413_and_counted(make_server: Callable[..., LiveServer]) -> None:
    srv = make_server(max_body_bytes=4096)
    big = json.dumps({**COMPLETION, "prompt": "x" * 10_000}).encode()
    for _ in range(3):
        response = httpx.post(f"{srv.v1}/completions", content=big)
        assert error_of(response, 413)["code"] == "request_too_large"
    metrics = httpx.get(f"{srv.url}/metrics").text
    [line] = [ln for ln in metrics.splitlines() if 'status="413"' in ln and "requests_total" in ln]
    assert line.endswith(" 3.0")


def test_reliability_settings_reach_the_arm() -> None:
    settings = Settings(backend="sim", max_prompt_tokens=77, max_queue_wait_s=3.5)
    assert serving_options(settings).max_prompt_tokens == 77
    assert scheduler_config(settings).max_queue_wait_s == 3.5


# -- a flood of huge prompts ----------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set (the in-process server included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def flood(url: str, bodies: list[bytes], concurrency: int) -> dict[int, int]:
    """POST every body (concurrently, bounded); count the answers by status."""
    statuses: dict[int, int] = {}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(body: bytes) -> None:
            async with gate:
                response = await client.post(url, content=body)
            if response.status_code != 200:
                error_of(response, response.status_code)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        await asyncio.gather(*(one(b) for b in bodies))
    return statuses


def test_flood_of_huge_prompts_is_refused_with_bounded_memory(
    make_server: Callable[..., LiveServer],
) -> None:
    """Too-big bodies (413), too-long prompts (400) and a full queue (429): RSS levels off."""
    options = ServingOptions(max_waiting_requests=4, max_prompt_tokens=2048)
    arm = sim_arm(
        time_scale=0.5, max_num_seqs=4, max_model_len=4096, num_blocks=2048, options=options
    )
    srv = make_server(arm, max_body_bytes=256 * 1024)
    url = f"{srv.v1}/completions"
    oversized = json.dumps({**COMPLETION, "prompt": "x" * (1 << 20)}).encode()
    too_long = json.dumps({**COMPLETION, "prompt": "y" * 200_000}).encode()
    queued = json.dumps({**COMPLETION, "prompt": "z" * 2000, "max_tokens": 64}).encode()
    bodies = [oversized, too_long, queued] * 40

    def round_() -> dict[int, int]:
        statuses = asyncio.run(flood(url, bodies, concurrency=16))
        gc.collect()
        return statuses

    before = rss_bytes()
    first = round_()
    after_first = rss_bytes()
    for _ in range(2):
        statuses = round_()
    after_third = rss_bytes()
    assert first[413] == statuses[413] == 40 and first[400] == statuses[400] == 40
    assert statuses.get(429, 0) > 0 and statuses.get(200, 0) > 0
    assert set(statuses) <= {200, 400, 413, 429}
    mib = 1 << 20
    assert after_first - before < 150 * mib, (before, after_first)
    assert after_third - after_first < 32 * mib, (after_first, after_third)
    engine = srv.arm.engine
    assert engine.num_waiting == 0 and engine.num_running == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
