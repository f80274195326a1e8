"""Graceful shutdown of a real `carousel serve --backend sim` on SIGTERM.

Design (docs/reliability.md): the listener stays open while draining, so a new request gets
503 `server_shutting_down` (not a refused connection); requests in flight get
`drain_timeout_s` to finish, then end with an error (in-band for streams, then [DONE]); the
process exits 0.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.serve_process import Served, serve_processes


@contextmanager
def carousel_serve(tmp_path: Path, *flags: str) -> Iterator[Served]:
    """`carousel serve --backend sim` on a free port (tests/serve_process.py), its log in
    `tmp_path/serve.log`; stopped at exit if a test left it running."""
    args = ["--backend", "sim", "--served-model-name", "sim", *flags]
    with serve_processes([(args, "serve")], tmp_path) as (serving,):
        yield serving


def healthy(serving: Served) -> bool:
    try:
        return httpx.get(f"{serving.url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim",
        "messages": [{"role": "user", "content": "a long story please"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@contextmanager
def stream_in_flight(
    srv: Served, http: httpx.Client, max_tokens: int
) -> Iterator[tuple[Iterator[str], str]]:
    """A streamed chat on `srv`, entered once its first data chunk arrived: (lines, that chunk).

    NOTE: keep the line iterator alive while the stream matters: a dropped one closes it.
    """
    url = f"{srv.url}/v1/chat/completions"
    with http.stream("POST", url, json=chat(max_tokens, True)) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        yield lines, first


def wait_draining(url: str, timeout_s: float = 5.0) -> httpx.Response:
    """The first /health answer after SIGTERM that says the server is draining."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{url}/health", timeout=2)
        if response.status_code == 503:
            return response
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.02)


def read_events(lines: Iterator[str]) -> list[str]:
    """The remaining `data:` payloads of a stream, [DONE] included."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def assert_shutting_down(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert response.headers["retry-after"] == "1"


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path: Path) -> None:
    flags = ("--sim-time-scale", "1", "--drain-timeout-s", "8")
    with (
        carousel_serve(tmp_path, *flags) as srv,
        httpx.Client(timeout=30) as http,
        stream_in_flight(srv, http, 300) as (lines, first),
    ):
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"]
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert_shutting_down(wait_draining(srv.url))
        fresh = httpx.post(f"{srv.url}/v1/chat/completions", json=chat(2, False), timeout=5)
        assert_shutting_down(fresh)
        assert fresh.headers["connection"] == "close"
        assert httpx.get(f"{srv.url}/metrics", timeout=5).status_code == 200  # a last scrape
        assert srv.proc.poll() is None  # still draining: the stream is in flight
        events = read_events(lines)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert srv.proc.wait(8 + 5) == 0
        assert time.monotonic() - signalled < 8 + 5
    log = srv.log.read_text()
    assert '"drain_started"' in log and '"drain_finished"' in log and "drain_timeout" not in log


def test_sigterm_ends_what_outlives_the_drain_with_an_error(tmp_path: Path) -> None:
    flags = ("--sim-time-scale", "1", "--drain-timeout-s", "1")
    with (
        carousel_serve(tmp_path, *flags) as srv,
        httpx.Client(timeout=30) as http,
        stream_in_flight(srv, http, 3000) as (lines, _),
    ):
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events = read_events(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert time.monotonic() - signalled < 1 + 4
        assert srv.proc.wait(1 + 5) == 0
        assert time.monotonic() - signalled < 1 + 5
    log = srv.log.read_text()
    assert '"drain_timeout"' in log
    requests = [json.loads(line) for line in log.splitlines() if '"event": "request"' in line]
    assert [r["status"] for r in requests] == [503]  # the cut stream, logged once


def test_sigterm_cuts_a_waiting_non_streamed_request_with_503(tmp_path: Path) -> None:
    flags = ("--sim-time-scale", "1", "--drain-timeout-s", "0.5", "--max-num-seqs", "1")
    with carousel_serve(tmp_path, *flags) as srv, httpx.Client(timeout=30) as http:
        url = f"{srv.url}/v1/chat/completions"
        with stream_in_flight(srv, http, 3000) as (_lines, _), ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, url, json=chat(5, False), timeout=30)
            deadline = time.monotonic() + 10
            while num_waiting(srv.url) < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            assert_shutting_down(waiting.result(timeout=0.5 + 5))
        assert srv.proc.wait(0.5 + 5) == 0
    assert not healthy(srv)  # the listener is closed now: connections are refused


def num_waiting(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    [line] = [ln for ln in text.splitlines() if ln.startswith("carousel_num_requests_waiting{")]
    return float(line.rsplit(" ", 1)[1])


def test_a_second_sigterm_ends_in_flight_streams_at_once(tmp_path: Path) -> None:
    flags = ("--sim-time-scale", "1", "--drain-timeout-s", "30")
    with (
        carousel_serve(tmp_path, *flags) as srv,
        httpx.Client(timeout=30) as http,
        stream_in_flight(srv, http, 3000) as (lines, _),
    ):
        srv.proc.send_signal(signal.SIGTERM)
        wait_draining(srv.url)
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events = read_events(lines)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert srv.proc.wait(10) == 0
        assert time.monotonic() - signalled < 5  # not the 30 s drain
    assert '"drain_skipped"' in srv.log.read_text()
