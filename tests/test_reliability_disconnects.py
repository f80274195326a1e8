"""A disconnect storm: 200 clients leave at random points while others are served.

The others finish correctly, every KV block comes back and the running gauge returns to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from schedulers.sequence import FinishReason, Sequence
from tests.conftest import SIM_MODEL, LiveServer, sim_arm, sse_payloads

LEAVERS = 200
STAYERS = 24
STAYER_TOKENS = 40


def body(stream: bool, max_tokens: int, i: int) -> dict[str, Any]:
    return {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": f"client {i} says hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


async def leave_before_first_token(client: httpx.AsyncClient, url: str, i: int) -> None:
    async with client.stream("POST", url, json=body(True, 500, i)) as response:
        assert response.status_code in (200, 429)


async def leave_mid_stream(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> None:
    wanted = rng.randint(1, 30)
    async with client.stream("POST", url, json=body(True, 500, i)) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= wanted:
                return  # leaving the block closes the connection mid-stream


async def leave_unstreamed(client: httpx.AsyncClient, url: str, i: int) -> None:
    await client.post(url, json=body(False, 500, i))


async def leaver(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> str:
    """Start a request and walk away at a random point; returns which kind it was."""
    await asyncio.sleep(rng.uniform(0, 2.0))
    kind = rng.choice(["before_first_token", "mid_stream", "unstreamed"])
    if kind == "mid_stream":
        await leave_mid_stream(client, url, i, rng)
        return kind
    call = leave_before_first_token if kind == "before_first_token" else leave_unstreamed
    task = asyncio.ensure_future(call(client, url, i))
    await asyncio.sleep(
        rng.uniform(0.0, 0.05) if kind == "before_first_token" else rng.uniform(0.05, 1.5)
    )
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.TransportError):
        await task
    return kind


async def stayer(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> None:
    """A client that stays to the end: its answer must be whole."""
    await asyncio.sleep(rng.uniform(0, 2.0))
    stream = i % 2 == 0
    response = await client.post(url, json=body(stream, STAYER_TOKENS, i))
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(p) for p in sse_payloads(response.text)]
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == STAYER_TOKENS
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    else:
        reply = response.json()
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == STAYER_TOKENS
        text = reply["choices"][0]["message"]["content"]
    assert len(text) == STAYER_TOKENS  # one character per simulated token


def gauge(text: str, name: str) -> float:
    [line] = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_disconnect_storm_frees_everything_and_spares_the_others(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(sim_arm(time_scale=0.5, num_blocks=4096, max_num_seqs=32))
    engine = srv.arm.engine
    url = f"{srv.v1}/chat/completions"
    rng = random.Random(8)
    reasons: list[FinishReason | None] = []

    def on_finish(seq: Sequence) -> None:
        reasons.append(seq.finish_reason)

    engine.finish_listeners.append(on_finish)

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=LEAVERS + STAYERS + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            leaving = [leaver(client, url, i, random.Random(rng.random())) for i in range(LEAVERS)]
            staying = [stayer(client, url, i, random.Random(rng.random())) for i in range(STAYERS)]
            results = await asyncio.gather(*leaving, *staying)
        return [r for r in results if isinstance(r, str)]

    kinds = asyncio.run(storm())
    assert {kinds.count(k) > 20 for k in ("before_first_token", "mid_stream", "unstreamed")} == {
        True
    }
    deadline = time.monotonic() + 10
    blocks = engine.block_manager
    while engine.num_running or engine.num_waiting or blocks.num_free_blocks != blocks.num_blocks:
        assert time.monotonic() < deadline, (engine.num_running, blocks.num_free_blocks)
        time.sleep(0.05)
    mid_stream = kinds.count("mid_stream")
    assert reasons.count(FinishReason.ABORT) >= mid_stream  # they left after <= 30 of 500
    assert reasons.count(FinishReason.LENGTH) >= STAYERS
    assert FinishReason.ERROR not in reasons
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert gauge(metrics, "carousel_num_requests_running") == 0
    assert gauge(metrics, "carousel_num_requests_waiting") == 0
    assert gauge(metrics, "carousel_kv_cache_usage_perc") == 0
    assert engine.is_alive and httpx.get(f"{srv.url}/health").status_code == 200
