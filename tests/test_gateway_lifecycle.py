"""Disconnects free KV; health, models, metrics and version endpoints; clean shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.local import LocalArm
from gateway.settings.load import Settings
from schedulers.sequence import FinishReason, Sequence
from tests.conftest import SIM_MODEL, LiveServer, serve_app, sim_arm

# NOTE: time_scale=1 makes each simulated iteration take ~4 ms: 900 tokens take seconds.
LONG_CHAT = {
    "model": SIM_MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story"}],
    "max_tokens": 900,
}


def slow_server(make_server: Callable[..., LiveServer]) -> tuple[LiveServer, list[FinishReason]]:
    srv = make_server(sim_arm(time_scale=1.0, num_blocks=256))
    reasons: list[FinishReason] = []

    def on_finish(seq: Sequence) -> None:
        assert seq.finish_reason is not None
        reasons.append(seq.finish_reason)

    srv.arm.engine.finish_listeners.append(on_finish)
    return srv, reasons


def assert_kv_returns(arm: LocalArm, timeout_s: float = 1.5) -> None:
    engine = arm.engine
    blocks = engine.block_manager
    deadline = time.monotonic() + timeout_s
    while engine.num_running or blocks.num_free_blocks != blocks.num_blocks:
        assert time.monotonic() < deadline, (engine.num_running, blocks.num_free_blocks)
        time.sleep(0.01)


def wait_running(arm: LocalArm) -> None:
    deadline = time.monotonic() + 5
    while arm.engine.num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_streaming_disconnect_aborts_and_frees_kv(make_server: Callable[..., LiveServer]) -> None:
    srv, reasons = slow_server(make_server)
    started = time.monotonic()
    with httpx.Client(timeout=30) as http:
        body = {**LONG_CHAT, "stream": True}
        with http.stream("POST", f"{srv.v1}/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(8), lines, strict=False) if line]
            assert len(received) >= 3
            assert srv.arm.engine.block_manager.num_free_blocks < 256  # it holds KV now
    assert_kv_returns(srv.arm)
    assert reasons == [FinishReason.ABORT]
    assert time.monotonic() - started < 3.0  # far less than the 900 tokens would take


def test_non_streaming_disconnect_aborts_and_frees_kv(
    make_server: Callable[..., LiveServer],
) -> None:
    srv, reasons = slow_server(make_server)
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):  # the client gives up and hangs up
        client.chat.completions.create(**LONG_CHAT)
    assert_kv_returns(srv.arm)
    assert reasons == [FinishReason.ABORT]


def test_sdk_stream_close_aborts(make_server: Callable[..., LiveServer]) -> None:
    srv, reasons = slow_server(make_server)
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    stream = client.chat.completions.create(**LONG_CHAT, stream=True, n=2)
    next(iter(stream))
    wait_running(srv.arm)
    stream.close()
    assert_kv_returns(srv.arm)
    assert reasons == [FinishReason.ABORT, FinishReason.ABORT]


def test_keep_alive_pings_are_comments_between_events(
    make_server: Callable[..., LiveServer],
) -> None:
    """`sse_ping_s`: `: ping` comment lines go out while tokens are slow; the SDK skips them."""
    srv = make_server(sim_arm(time_scale=25.0), sse_ping_s=0.02)  # ~100 ms per token
    body = {**LONG_CHAT, "max_tokens": 3, "stream": True}
    with httpx.Client(timeout=30) as http:
        raw = http.post(f"{srv.v1}/chat/completions", json=body).text
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    pings = [e for e in events if e == ": ping"]
    data = [e for e in events if e.startswith("data: ")]
    assert len(pings) >= 3 and len(pings) + len(data) == len(events) - 1, events
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(**{**body, "stream": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert_kv_returns(srv.arm)


def test_no_pings_by_default(server: LiveServer) -> None:
    body = {**LONG_CHAT, "max_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30).text
    assert all(e.startswith("data: ") for e in raw.split("\n\n")[:-1]), raw


def test_concurrent_requests_all_complete(make_server: Callable[..., LiveServer]) -> None:
    srv = make_server(sim_arm(time_scale=0.2, max_num_seqs=4))
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    results: list[str] = []

    def one(i: int) -> None:
        r = client.completions.create(model=SIM_MODEL, prompt=f"p{i}", max_tokens=20)
        results.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["length"] * 8
    assert_kv_returns(srv.arm)


def test_models_list_and_retrieve(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    [card] = client.models.list().data
    assert card.id == SIM_MODEL and card.object == "model" and card.owned_by == "carousel"
    assert client.models.retrieve(SIM_MODEL).id == SIM_MODEL


def test_health_version_and_metrics(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    body = {"model": SIM_MODEL, "prompt": "abc", "max_tokens": 4}
    httpx.post(f"{server.v1}/completions", json=body)
    httpx.post(f"{server.v1}/completions", json={**body, "model": "nope"})
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text

    def value(prefix: str) -> float:
        [line] = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        return float(line.rsplit(" ", 1)[1])

    ok = f'carousel_requests_total{{arm="orca",endpoint="completions",model="{SIM_MODEL}"'
    assert value(ok + ',status="200"}') >= 1
    assert value('carousel_requests_total{arm="",endpoint="completions",model="nope"') >= 1
    labels = f'{{arm="orca",model="{SIM_MODEL}"}}'
    assert value(f"carousel_prompt_tokens_total{labels}") >= 3
    assert value(f"carousel_generation_tokens_total{labels}") >= 4
    assert value(f"carousel_num_requests_running{labels}") == 0
    assert value(f"carousel_num_requests_waiting{labels}") == 0
    assert f"carousel_time_to_first_token_seconds_count{labels}" in text


def test_shutdown_stops_the_engine_thread() -> None:
    arm = sim_arm()
    app = create_app(Settings(backend="sim"), [Deployment(SIM_MODEL, [arm])])
    with serve_app(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine = arm.engine
        assert engine.is_alive
    assert not engine.is_alive


async def test_payload_stream_closed_before_its_first_chunk_still_releases() -> None:
    from collections.abc import AsyncGenerator

    from gateway.api.payload_stream import PayloadStream

    released: list[bool] = []

    async def chunks() -> AsyncGenerator[str, None]:
        try:
            yield "never"
        finally:
            released.append(False)  # a never-started generator does not get here

    stream = PayloadStream(chunks(), lambda: released.append(True))
    await stream.aclose()
    assert released == [True]


def test_static_scheduler_serves_the_same_api(make_server: Callable[..., LiveServer]) -> None:
    srv = make_server(sim_arm(scheduler="static"))
    client = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0)
    reply = client.completions.create(model=SIM_MODEL, prompt=["a", "b"], max_tokens=3)
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert srv.arm.engine.scheduler.name == "static"
