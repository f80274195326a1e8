"""`carousel serve` (and `carousel bench`) as real processes for end-to-end tests: a free
loopback port, the health wait, and a stop by its own pid (SIGINT, then kill)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 60) -> None:
    """Until `url`/health answers 200; fails with the server's log if it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{url} never became healthy\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


class Served(NamedTuple):
    """One `carousel serve` process: its handle (for its pid), its URL and its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@contextmanager
def carousel_serve(args: list[str], folder: Path, name: str = "serve") -> Iterator[str]:
    """`carousel serve ARGS` from `folder` on a free loopback port, with this checkout's code
    first on the path (not whatever the venv's editable install points at) and no CAROUSEL_*
    variables of the test run; yields its URL; its output goes to `folder/NAME.log`."""
    with carousel_serves([(args, name)], folder) as (url,):
        yield url


@contextmanager
def carousel_serves(runs: list[tuple[list[str], str]], folder: Path) -> Iterator[list[str]]:
    """Several `carousel serve ARGS` processes (as `carousel_serve`, each `(ARGS, NAME)`),
    started together so their start-ups overlap; yields their URLs once all are healthy."""
    with serve_processes(runs, folder) as served:
        yield [s.url for s in served]


@contextmanager
def serve_processes(
    runs: list[tuple[list[str], str]], folder: Path, health_timeout_s: float = 60
) -> Iterator[list[Served]]:
    """As `carousel_serves`, yielding each process too (a test that signals or kills one by
    its pid, or reads its log); `health_timeout_s` for a start-up that loads a model."""
    with ExitStack() as stack:
        served = []
        for args, name in runs:
            port = free_port()
            command = ["serve", *args, "--port", str(port)]
            proc = stack.enter_context(carousel_process(command, folder, name))
            served.append(Served(proc, f"http://127.0.0.1:{port}", folder / f"{name}.log"))
        for proc, url, log in served:
            wait_healthy(proc, url, log, health_timeout_s)
        yield served


@contextmanager
def carousel_process(
    command: list[str], folder: Path, name: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m gateway.cli COMMAND` from `folder`, this checkout first on the path and no
    CAROUSEL_* variables of the test run, its output in `folder/NAME.log`; stopped at exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAROUSEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with (folder / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *command],
            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """Stop `proc` by its pid: SIGINT (a clean stop), then kill if it is still running."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
