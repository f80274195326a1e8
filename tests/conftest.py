"""Shared fixtures: a live Carousel server (uvicorn on a loopback socket, in a thread); the
suite's hooks for running under pytest-xdist (tests/parallel.py)."""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.local import LocalArm
from gateway.settings.load import Settings
from schedulers.base import SchedulerConfig
from tests import parallel
from tests.background_builds import avx2_build_in_background

SIM_MODEL = "sim-model"
#: a minimal valid chat body for the simulator server
CHAT = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def pytest_configure(config: pytest.Config) -> None:
    parallel.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    parallel.unconfigure(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    parallel.mark_timed_tests_serial(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` handing out the longest files first and those with `serial` tests
    last (tests/file_order.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.file_order import LongestFilesFirst

    return LongestFilesFirst(config, log)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[object]:
    """Under xdist, each test holds the machine as tests/parallel.py says (outermost, so a
    wait for the lock is not counted in the test's timeout)."""
    with parallel.machine_share(item):
        return (yield)


class LoopKiller(BaseException):
    """Escapes the engine's per-step error handling: the loop itself dies."""


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of `response`, asserting its status and exact shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@dataclass
class LiveServer:
    """A running app: its base URL, the app, and the local arm behind `SIM_MODEL`."""

    url: str
    app: FastAPI
    arm: LocalArm

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def serve_app(
    app: FastAPI, ready_path: str | None = "/health", ready_timeout_s: float = 30.0
) -> Iterator[str]:
    """Run `app` on 127.0.0.1:<free port> in a thread; yields the base URL; stops at exit.

    With `ready_path`, waits until it answers 200 (the arms have loaded)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        if ready_path is not None:
            while httpx.get(url + ready_path).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the test server did not become ready")
                time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def sim_arm(
    *,
    time_scale: float = 0.0,
    num_blocks: int = 512,
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    options: ServingOptions | None = None,
    scheduler: str = "orca",
) -> LocalArm:
    """A local arm over the weight-free simulator backend."""
    backend = SimBackend(num_blocks=num_blocks, max_model_len=max_model_len, time_scale=time_scale)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    return LocalArm.from_backend(backend, scheduler=scheduler, config=config, options=options)


def start_server(
    stack: ExitStack, arm: LocalArm | None = None, wait_ready: bool = True, **settings: Any
) -> LiveServer:
    """Start an app serving `arm` as SIM_MODEL; it stops when `stack` closes."""
    arm = arm or sim_arm()
    settings.setdefault("served_model_name", SIM_MODEL)
    app = create_app(Settings(backend="sim", **settings), [Deployment(SIM_MODEL, [arm])])
    url = stack.enter_context(serve_app(app, "/health" if wait_ready else None))
    return LiveServer(url, app, arm)


@pytest.fixture
def no_gc_pauses() -> Iterator[None]:
    """The suite's heap frozen for a test that times a window of under a second (arrivals to
    within tens of milliseconds, a first event, a burst of calls, an idle engine's CPU).

    Late in a full run this process holds about a million objects, and one full collection
    then stops every thread for 0.6-0.7 s: long enough to send a replayed request past its
    tolerance, as one CI run saw. A served gateway freezes its own heap after start-up
    (gateway/state.py), and the bench client runs in a small process of its own.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def make_server() -> Iterator[Callable[..., LiveServer]]:
    """Factory: `make_server(arm=..., **settings)` starts a server; all stop at teardown."""
    with ExitStack() as stack:
        yield lambda arm=None, wait_ready=True, **settings: start_server(
            stack, arm, wait_ready, **settings
        )


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    """One shared fast server (instant simulator) for tests that do not change settings."""
    with ExitStack() as stack:
        yield start_server(stack)


@pytest.fixture(scope="session")
def default_model_url() -> Iterator[str]:
    """The default model (SmolLM2-135M-Instruct, torch backend, its default dtype) served once
    per session (per xdist worker) for every module that only sends it requests: its start-up
    is the slowest part of those modules (20-50 s here). The first load converts the GGUF
    into ~/.cache/carousel (about 20 s more)."""
    settings = Settings(backend="torch", model="default", max_model_len=2048, max_num_seqs=4)
    with serve_app(create_app(settings), ready_timeout_s=300) as url:
        yield url


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads before `[DONE]`, asserting OpenAI's exact framing on the way."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        if event.startswith(":"):  # a keep-alive comment
            continue
        assert event.startswith("data: ") and "\n" not in event, event
        payloads.append(event.removeprefix("data: "))
    assert payloads.pop() == "[DONE]" and "[DONE]" not in payloads
    return payloads


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a loopback port, shared by the session's tests (flush what you
    write, or use your own key prefix): tests/redis_server.py."""
    from tests.redis_server import redis_server

    with redis_server() as url:
        yield url


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built(request: pytest.FixtureRequest) -> Iterator[None]:
    """Carousel's CPU kernels built (or found) before any test starts a server, as before
    issue 52: a server that finds them missing serves on torch's ops and builds them in the
    background, whose compilers a test that stops its server would leave running
    (tests/test_kernel_switch.py tests that path with backends of its own). Under xdist each
    worker asks; the build's lock lets one build and the other import it. Then the AVX2
    build, where the session runs its test, starts in the background
    (tests/background_builds.py)."""
    from backends.torch import kernels

    kernels.native()
    with avx2_build_in_background(request.session.items):
        yield
