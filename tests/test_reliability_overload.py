"""Overload and engine faults over HTTP: a bounded queue (429), a cap on queue wait (429
`queue_timeout`, in-band for streams), a failed step fails only its requests, a dead loop
turns the server 503. No request is lost and every KV block comes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from backends.sim import CostModel, SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.arms.local import LocalArm
from schedulers.base import SchedulerConfig
from schedulers.block_manager import BlockManager
from schedulers.outputs import IterationRecord
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import QUEUE_TIMEOUT, FinishReason, Sequence
from tests.conftest import CHAT, LiveServer, LoopKiller, error_of, sse_payloads


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def arm(
    *,
    time_scale: float = 1.0,
    max_num_seqs: int = 1,
    max_queue_wait_s: float | None = None,
    options: ServingOptions | None = None,
    cost: CostModel | None = None,
) -> LocalArm:
    backend = SimBackend(num_blocks=256, max_model_len=1024, time_scale=time_scale, cost=cost)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_queue_wait_s=max_queue_wait_s)
    return LocalArm.from_backend(backend, config=config, options=options)


def assert_all_blocks_free(srv: LiveServer) -> None:
    engine = srv.arm.engine
    blocks = engine.block_manager
    wait_until(lambda: blocks.num_free_blocks == blocks.num_blocks and engine.num_running == 0)
    assert engine.num_waiting == 0


def stream_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(p) for p in sse_payloads(response.read().decode())]


# -- the waiting queue ------------------------------------------------------------------------


def test_expire_waiting_spares_running_and_preempted_sequences() -> None:
    config = SchedulerConfig(max_num_seqs=1, max_queue_wait_s=1.0)
    scheduler = create_scheduler("orca", config, BlockManager(64, 4))
    params = SamplingParams(max_tokens=4)
    seqs = [Sequence(i, f"r{i}", [1, 2, 3], params, arrival_time=100.0) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()  # seq 0 runs
    seqs[1].first_scheduled_time = 100.5  # as if it ran once and was preempted
    assert scheduler.expire_waiting(100.9) == []
    assert scheduler.expire_waiting(101.2) == [seqs[2]]
    assert seqs[2].finish_reason is FinishReason.ERROR and seqs[2].error_code == QUEUE_TIMEOUT
    assert "1.2 s" in (seqs[2].error or "")
    assert list(scheduler.waiting) == [seqs[1]] and scheduler.running == [seqs[0]]
    assert seqs[2].block_table == []


def test_queue_wait_cap_is_429_or_an_in_band_error_and_frees_everything(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(arm(max_queue_wait_s=0.3, options=ServingOptions(retry_after_s=2)))
    url = f"{srv.v1}/chat/completions"
    long = {**CHAT, "max_tokens": 600, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=long) as running:
        wait_until(lambda: srv.arm.engine.num_running == 1)
        started = time.monotonic()
        refused = http.post(url, json=CHAT)
        assert time.monotonic() - started < 3.0
        error = error_of(refused, 429)
        assert error["code"] == QUEUE_TIMEOUT and error["type"] == "rate_limit_error"
        assert refused.headers["retry-after"] == "2"
        with http.stream("POST", url, json={**CHAT, "stream": True}) as streamed:
            assert streamed.status_code == 200  # the 200 went out before the queue gave up
            events = stream_events(streamed)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["error"]["code"] == QUEUE_TIMEOUT
        assert srv.arm.engine.num_running == 1  # the running request is untouched
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    assert_all_blocks_free(srv)


def test_burst_never_queues_more_than_max_waiting_requests(
    make_server: Callable[..., LiveServer],
) -> None:
    """Submissions between two engine iterations count as waiting (the bound is hard): with
    both slots held by streams that do not end by themselves, a burst gets exactly
    `max_waiting_requests` in and 429s for the rest, whatever the machine's speed; those
    run once the holders leave."""
    slow = CostModel(fixed_s=0.25, per_token_s=0.0, per_context_token_s=0.0)
    options = ServingOptions(max_waiting_requests=3)
    srv = make_server(arm(max_num_seqs=2, options=options, cost=slow))
    engine = srv.arm.engine
    url = f"{srv.v1}/chat/completions"
    waiting_seen: list[int] = []

    def on_iteration(record: IterationRecord) -> None:
        waiting_seen.append(record.num_waiting)

    engine.iteration_listeners.append(on_iteration)

    async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "condition not reached in time"
            await asyncio.sleep(0.01)

    async def burst() -> tuple[list[int], list[int]]:
        holding = {**CHAT, "max_tokens": 1000, "stream": True}  # 250 s: ended by the test
        async with httpx.AsyncClient(timeout=60) as client:
            async with contextlib.AsyncExitStack() as holders:
                for _ in range(2):
                    held = await holders.enter_async_context(
                        client.stream("POST", url, json=holding)
                    )
                    assert held.status_code == 200
                await until(lambda: engine.num_running == 2)
                posts = [asyncio.ensure_future(client.post(url, json=CHAT)) for _ in range(22)]
                await until(lambda: sum(p.done() for p in posts) == 22 - 3)
                refused = [p.result().status_code for p in posts if p.done()]
                queued = [p for p in posts if not p.done()]
                assert engine.num_waiting == 3 and engine.num_running == 2
            # the holders have gone: the three that waited run now
            served = [r.status_code for r in await asyncio.gather(*queued)]
        return refused, served

    refused, served = asyncio.run(burst())
    assert refused == [429] * 19
    assert served == [200] * 3
    assert max(waiting_seen) <= 3, waiting_seen
    assert_all_blocks_free(srv)


# -- engine faults ------------------------------------------------------------------------------


def test_a_failed_step_ends_only_its_streams_and_serving_goes_on(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(arm(max_num_seqs=3))
    backend = srv.arm.engine.backend
    assert isinstance(backend, SimBackend)
    url = f"{srv.v1}/chat/completions"
    body = {**CHAT, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as http:
        with (
            http.stream("POST", url, json=body) as a,
            http.stream("POST", url, json=body) as b,
            http.stream("POST", url, json=body) as c,
        ):
            wait_until(lambda: srv.arm.engine.num_running == 3)
            backend.fail_next = RuntimeError("device fault at 0xbad")
            for response in (a, b, c):
                events = stream_events(response)
                assert events[-1]["error"]["type"] == "server_error"
                assert "0xbad" not in json.dumps(events)
        assert srv.arm.engine.is_alive
        assert http.post(url, json=CHAT).status_code == 200
        assert http.get(f"{srv.url}/health").status_code == 200
    assert_all_blocks_free(srv)


def test_a_dead_loop_fails_everything_in_flight_and_then_refuses(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(arm(max_num_seqs=1))
    engine = srv.arm.engine
    backend = engine.backend
    assert isinstance(backend, SimBackend)
    url = f"{srv.v1}/chat/completions"

    async def scenario() -> tuple[list[dict[str, Any]], httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            request = client.build_request(
                "POST", url, json={**CHAT, "max_tokens": 400, "stream": True}
            )
            streamed = await client.send(request, stream=True)
            waiting = asyncio.ensure_future(client.post(url, json=CHAT))
            while engine.num_waiting < 1:
                await asyncio.sleep(0.01)
            backend.fail_next = LoopKiller()  # type: ignore[assignment]
            events = [json.loads(p) for p in sse_payloads((await streamed.aread()).decode())]
            return events, await waiting

    events, waiting = asyncio.run(scenario())
    assert events[-1]["error"]["code"] == "engine_dead"
    assert error_of(waiting, 503)["code"] == "engine_dead"
    assert error_of(httpx.post(url, json=CHAT), 503)["code"] == "engine_dead"
    assert error_of(httpx.get(f"{srv.url}/health"), 503)["code"] == "engine_dead"
    assert httpx.get(f"{srv.url}/metrics").status_code == 200
    assert not engine.is_alive and engine.num_running == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
