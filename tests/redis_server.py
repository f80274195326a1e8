"""A real redis-server on a loopback port for the tests that need a shared store.

`.ci/run` installs Debian's `redis-server` (scripts/ci-services.sh); where it is missing the
tests that use `redis_url` skip, unless CAROUSEL_REQUIRE_REDIS=1 (set by CI) makes that a
failure, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.serve_process import free_port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server() -> Iterator[str]:
    """Start a throwaway redis-server on 127.0.0.1 (no persistence) and yield its URL; it is
    stopped by its own pid on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CAROUSEL_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (CAROUSEL_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed (scripts/ci-services.sh installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10.0
            while not _answers(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
