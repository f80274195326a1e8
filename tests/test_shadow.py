"""Shadow arms: a copy of every accepted request, answers discarded, metrics of their own,
and never a delay, an error or a header for the client."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backends.upstream import UpstreamConfig
from gateway.app import create_app
from gateway.arms.arm import Arm
from gateway.arms.deployment import Deployment
from gateway.arms.shadow import ShadowMirror, mirrored
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from tests.conftest import CHAT, SIM_MODEL, serve_app, sim_arm


def shadowed(arm: Arm, fraction: float = 1.0) -> Arm:
    arm.shadow, arm.shadow_fraction = True, fraction
    return arm


@contextmanager
def gateway(*arms: Arm, queue_size: int = 256, concurrency: int = 32) -> Iterator[str]:
    settings = Settings(backend="sim", served_model_name=SIM_MODEL)
    deployment = Deployment(SIM_MODEL, list(arms))
    for mirror in deployment.mirrors:
        mirror.queue_size, mirror.concurrency = queue_size, concurrency
    with serve_app(create_app(settings, [deployment])) as url:
        MIRRORS[url] = deployment.mirrors
        yield url


MIRRORS: dict[str, list[ShadowMirror]] = {}


def series(url: str, name: str, arm: str) -> float:
    """The sum of a counter's samples for one arm in /metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name) and f'arm="{arm}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_shadow_gets_a_copy_of_every_accepted_request_and_no_traffic_of_its_own() -> None:
    primary, shadow = sim_arm(), shadowed(sim_arm())
    primary.name, shadow.name = "primary", "shadow"
    with gateway(primary, shadow) as url:
        for i in range(6):
            body = {**CHAT, "stream": i % 2 == 0}
            response = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert response.headers["X-Carousel-Arm"] == "primary"
        bad = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 10**9})
        assert bad.status_code == 400  # refused by the primary: never mirrored
        total = "carousel_requests_total"
        wait_for(lambda: series(url, total, "shadow") == 6)
        assert series(url, total, "primary") == 7
        assert series(url, "carousel_generation_tokens_total", "shadow") == 12


def test_shadow_fraction_mirrors_that_share_by_request_id() -> None:
    primary, shadow = sim_arm(), shadowed(sim_arm(), fraction=0.5)
    primary.name, shadow.name = "primary", "shadow"
    ids = [f"req-{i}" for i in range(20)]
    expected = sum(mirrored(i, 0.5) for i in ids)
    assert 0 < expected < 20
    with gateway(primary, shadow) as url:
        for request_id in ids:
            headers = {"X-Request-Id": request_id}
            httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
        wait_for(lambda: series(url, "carousel_requests_total", "shadow") == expected)
        time.sleep(0.2)
        assert series(url, "carousel_requests_total", "shadow") == expected


# -- a slow, failing shadow never touches the primary ---------------------------------------


async def _slow_failure(request: Request) -> Response:
    await asyncio.sleep(1.0)
    return JSONResponse({"error": {"message": "shadow broke", "type": "server_error"}}, 500)


@pytest.fixture
def slow_failing_upstream() -> Iterator[str]:
    app = Starlette(routes=[Route("/v1/chat/completions", _slow_failure, methods=["POST"])])
    with serve_app(app, ready_path=None) as url:  # type: ignore[arg-type]
        yield url


def latencies(url: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        began = time.monotonic()
        response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": i % 2 == 1})
        out.append(time.monotonic() - began)
        assert response.status_code == 200, response.text
        assert "shadow" not in response.headers.get("X-Carousel-Arm", "")
        assert "shadow broke" not in response.text
    return out


def test_a_slow_failing_shadow_changes_nothing_for_the_client_and_counts_its_drops(
    slow_failing_upstream: str,
) -> None:
    config = UpstreamConfig(
        base_urls=(f"{slow_failing_upstream}/v1",), model="m", retries=0, health_interval_s=0
    )
    shadow = shadowed(UpstreamArm("shadow", config))
    with ExitStack() as stack:
        alone = stack.enter_context(gateway(_primary()))
        with_shadow = stack.enter_context(gateway(_primary(), shadow, queue_size=2, concurrency=1))
        [mirror] = MIRRORS[with_shadow]
        base = latencies(alone, 5)
        mirrored_ = latencies(with_shadow, 5)
        for _ in range(3):  # interleave, so drift hits both alike
            base += latencies(alone, 5)
            mirrored_ += latencies(with_shadow, 5)
        ratio = statistics.median(mirrored_) / statistics.median(base)
        assert ratio < 1.5, f"primary p50 {ratio:.2f}x slower with a failing shadow"
        dropped = series(with_shadow, "carousel_shadow_requests_dropped_total", "shadow")
        assert dropped == mirror.dropped > 0
        wait_for(lambda: series(with_shadow, "carousel_requests_total", "shadow") > 0, 15)
        statuses = httpx.get(f"{with_shadow}/metrics").text
        assert 'arm="shadow",endpoint="chat",model="sim-model",status="502"' in statuses


def _primary() -> Arm:
    arm = sim_arm(time_scale=1.0)
    arm.name = "primary"
    return arm


def test_a_shadow_copy_of_a_stored_response_neither_keeps_nor_finds_one() -> None:
    """The Responses store is the gateway's table's; a copy is served by the storeless one."""
    primary, shadow = sim_arm(), shadowed(sim_arm())
    primary.name, shadow.name = "primary", "shadow"
    settings = Settings(backend="sim", served_model_name=SIM_MODEL)
    app = create_app(settings, [Deployment(SIM_MODEL, [primary, shadow])])
    with serve_app(app) as url:
        body = {"model": SIM_MODEL, "input": "hi", "max_output_tokens": 2}
        first = httpx.post(f"{url}/v1/responses", json=body).json()
        after = {**body, "previous_response_id": first["id"]}
        assert httpx.post(f"{url}/v1/responses", json=after).status_code == 200
        total = "carousel_requests_total"
        wait_for(lambda: series(url, total, "shadow") == 2)
        store = app.state.gateway.response_store
        assert len(store) == 2  # the primary's two; the copies kept none
        metrics = httpx.get(f"{url}/metrics").text
    continued = [line for line in metrics.splitlines() if line.startswith(total)]
    assert any('arm="shadow"' in line and 'status="404"' in line for line in continued), continued
