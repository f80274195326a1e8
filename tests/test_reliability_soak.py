"""A bounded soak on loopback: mixed streamed, non-streamed, aborted and invalid requests.

Nothing is lost: every request ends in a completion or an OpenAI-shaped error (or, for the
ones the client walked away from, in `abort`/499 or a completion), the server's
`carousel_requests_total` by status adds up to the client's own tallies, every request id
the client sent reached the server, and at the end every KV block is free.
`CAROUSEL_SOAK_S` sets the duration (default 60 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import structlog
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.local import LocalArm
from gateway.settings.load import Settings
from schedulers.base import SchedulerConfig
from tests.conftest import SIM_MODEL, serve_app, sse_payloads

DURATION_S = float(os.environ.get("CAROUSEL_SOAK_S", "60"))
WORKERS = 10
ABORTED = -1  # the client left before an answer: the server says 200 or 499


class Arrivals:
    """ASGI wrapper recording the X-Request-Id of every HTTP request that reached the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.ids: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request_id = Headers(scope=scope).get("x-request-id")
            if request_id:
                self.ids.add(request_id)
        await self.app(scope, receive, send)


@dataclass
class Soak:
    url: str
    arm: LocalArm
    arrivals: Arrivals
    outcomes: dict[str, int] = field(default_factory=dict)  # request id -> status (or ABORTED)
    kinds: Counter[str] = field(default_factory=Counter)


@pytest.fixture
def soak() -> Iterator[Soak]:
    backend = SimBackend(num_blocks=1024, max_model_len=1024, time_scale=0.3)
    config = SchedulerConfig(max_num_seqs=8, max_queue_wait_s=0.5)
    options = ServingOptions(max_waiting_requests=6, default_max_tokens=64)
    arm = LocalArm.from_backend(backend, config=config, options=options)
    settings = Settings(backend="sim", served_model_name=SIM_MODEL, max_body_bytes=64 * 1024)
    app = create_app(settings, [Deployment(SIM_MODEL, [arm])])
    arrivals = Arrivals(app)
    with ExitStack() as stack:
        url = stack.enter_context(serve_app(arrivals))  # type: ignore[arg-type]
        yield Soak(url, arm, arrivals)


def assert_openai_error(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def status_of_in_band(error: dict[str, Any]) -> int:
    """The status the server logged for a stream that ended with this in-band error."""
    assert error["code"] == "queue_timeout", error  # the only one a healthy soak may see
    return 429


def chat(rng: random.Random, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if rng.random() < 0.5:
        body["n"] = 2
    return body


async def streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str) -> int:
    response = await client.post(url, json=body, headers={"X-Request-Id": rid})
    if response.status_code != 200:
        assert_openai_error(response.json())
        return response.status_code
    payloads = [json.loads(p) for p in sse_payloads(response.text)]
    if "error" in payloads[-1]:
        return status_of_in_band(assert_openai_error(payloads[-1]))
    finished = [c["choices"][0]["finish_reason"] for c in payloads if c["choices"]]
    assert finished.count("length") == body.get("n", 1), payloads[-3:]
    return 200


async def unary(client: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str) -> int:
    response = await client.post(url, json=body, headers={"X-Request-Id": rid})
    if response.status_code == 200:
        reply = response.json()
        assert [c["finish_reason"] for c in reply["choices"]] == ["length"] * body.get("n", 1)
        assert reply["usage"]["completion_tokens"] == body["max_tokens"] * body.get("n", 1)
    else:
        assert_openai_error(response.json())
    return response.status_code


async def abort_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str, leave_after: int
) -> int:
    async with client.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as response:
        if response.status_code != 200:
            assert_openai_error(json.loads(await response.aread()))
            return response.status_code
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= leave_after:
                return ABORTED
    return ABORTED  # the stream ended first; the server may still say 200


async def abort_unary(
    soak: Soak, client: httpx.AsyncClient, body: dict[str, Any], rid: str, after_s: float
) -> int:
    task = asyncio.ensure_future(unary(client, f"{soak.url}/v1/chat/completions", body, rid))
    deadline = time.monotonic() + 30
    while rid not in soak.arrivals.ids and not task.done():
        assert time.monotonic() < deadline, "the request never reached the server"
        await asyncio.sleep(0.005)
    await asyncio.sleep(after_s)
    if task.done():
        return task.result()  # answered before the client left (200 or 429)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return ABORTED


async def invalid(client: httpx.AsyncClient, url: str, rng: random.Random, rid: str) -> int:
    headers = {"X-Request-Id": rid}
    choice = rng.randrange(5)
    if choice == 0:
        response = await client.post(url, content=b'{"model": ', headers=headers)
    elif choice == 1:
        response = await client.post(
            url, json={**chat(rng, False, 4), "model": "nope"}, headers=headers
        )
    elif choice == 2:
        response = await client.post(url, json={**chat(rng, False, 4), "n": 0}, headers=headers)
    elif choice == 3:
        long = {**chat(rng, False, 4), "messages": [{"role": "user", "content": "a" * 1100}]}
        response = await client.post(url, json=long, headers=headers)
    else:
        response = await client.post(url, content=b"x" * (100 * 1024), headers=headers)
    expected = {0: 400, 1: 404, 2: 400, 3: 400, 4: 413}[choice]
    assert response.status_code == expected, response.text
    assert_openai_error(response.json())
    return expected


async def worker(soak: Soak, client: httpx.AsyncClient, seed: int, until: float) -> None:
    rng = random.Random(seed)
    url = f"{soak.url}/v1/chat/completions"
    while time.monotonic() < until:
        rid = f"soak-{uuid.uuid4().hex[:12]}"
        kind = rng.choices(
            ["stream", "unary", "abort_stream", "abort_unary", "invalid"], [3, 3, 1, 1, 2]
        )[0]
        call: Awaitable[int]
        if kind == "stream":
            call = streamed(client, url, chat(rng, True, rng.randint(4, 60)), rid)
        elif kind == "unary":
            call = unary(client, url, chat(rng, False, rng.randint(4, 60)), rid)
        elif kind == "abort_stream":
            body = chat(rng, True, 300)
            call = abort_stream(client, url, body, rid, rng.randint(1, 20))
        elif kind == "abort_unary":
            call = abort_unary(soak, client, chat(rng, False, 300), rid, rng.uniform(0, 0.5))
        else:
            call = invalid(client, url, rng, rid)
        soak.outcomes[rid] = await asyncio.wait_for(call, timeout=60)
        soak.kinds[kind] += 1


def server_counts(url: str) -> Counter[int]:
    """carousel_requests_total summed by status over every other label."""
    counts: Counter[int] = Counter()
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("carousel_requests_total{"):
            match = re.search(r'status="(\d+)"', line)
            assert match is not None
            counts[int(match.group(1))] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.slow
def test_soak_loses_nothing_and_the_counters_add_up(soak: Soak) -> None:
    async def run() -> None:
        until = time.monotonic() + DURATION_S
        limits = httpx.Limits(max_connections=WORKERS * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(worker(soak, client, seed, until) for seed in range(WORKERS)))

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
        engine = soak.arm.engine
        blocks = engine.block_manager
        wait_for(lambda: not engine.num_running and not engine.num_waiting, 10)
        wait_for(lambda: blocks.num_free_blocks == blocks.num_blocks, 5)
        client: Counter[int] = Counter(soak.outcomes.values())
        total = sum(client.values())
        wait_for(lambda: sum(server_counts(soak.url).values()) >= total, 5)
    server = server_counts(soak.url)
    summary = {"client": dict(client), "server": dict(server), "kinds": dict(soak.kinds)}
    assert sum(server.values()) == total, summary  # each request counted exactly once
    assert set(soak.outcomes) <= soak.arrivals.ids, summary  # and each reached the server
    assert not [s for s in server if s >= 500], summary

    logged = [entry for entry in logs if entry["event"] == "request"]
    by_id = Counter(entry["request_id"] for entry in logged)
    assert set(by_id) == set(soak.outcomes) and set(by_id.values()) == {1}  # one line each
    for entry in logged:  # the server's last word on each request matches the client's
        seen = soak.outcomes[entry["request_id"]]
        allowed = {200, 429, 499} if seen == ABORTED else {seen}
        assert entry["status"] in allowed, (entry, seen)

    # NOTE: a request the client left may have ended as 200, 499 or (queue timeout) 429
    for status in set(server) | set(client):
        if status not in (200, 429, 499, ABORTED):
            assert server[status] == client[status], (status, summary)
    ambiguous = (200, 429, 499)
    assert sum(server[s] for s in ambiguous) == client[200] + client[429] + client[ABORTED]
    assert server[200] >= client[200] and server[429] >= client[429], summary
    assert min(soak.kinds.values()) >= 10 and client[200] >= 100, summary
    assert server[499] > 0 and client[429] > 0 and client[413] > 0, summary
