"""`client_cpu_s`: the bench process's own CPU seconds over a run (bench/metrics.py), the load
the client put on a machine it shares with the server. Known answer: the same run with half a
second of busy loop inside it reads the CPU time that loop got more than with half a second
of sleep there instead; a wall-clock reading would see the two alike."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from bench import runner
from bench.cli import main
from bench.fake_server import fake_server
from tests.test_bench_live import bench_args

EXTRA_S = 0.5
REAL_RUN = runner.run_requests
#: the CPU seconds each busy loop got (a shared machine may give it less than its wall time)
BURNT: list[float] = []


def with_extra(waste: Callable[[], Coroutine[Any, Any, None]]) -> Callable[..., Any]:
    """`run_requests`, then `waste()` inside the measured run."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        outcome = await REAL_RUN(*args, **kwargs)
        await waste()
        return outcome

    return run


async def burn() -> None:
    cpu, until = time.process_time(), time.perf_counter() + EXTRA_S
    while time.perf_counter() < until:
        pass
    BURNT.append(time.process_time() - cpu)


async def sleep() -> None:
    await asyncio.sleep(EXTRA_S)


def client_cpu(monkeypatch: pytest.MonkeyPatch, out: Path, waste: Any) -> float:
    monkeypatch.setattr(runner, "run_requests", with_extra(waste))
    with fake_server() as (url, _):
        assert main(bench_args(url, out)) == 0
    [run] = json.loads((out / "report.json").read_text())["runs"]
    value: float = run["metrics"]["client_cpu_s"]
    assert value >= 0
    return value


def test_the_run_reports_the_clients_own_cpu_seconds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    BURNT.clear()
    client_cpu(monkeypatch, tmp_path / "warm", sleep)  # the process's first-use costs
    slept = client_cpu(monkeypatch, tmp_path / "slept", sleep)
    burnt = client_cpu(monkeypatch, tmp_path / "burnt", burn)
    [got] = BURNT
    assert got > EXTRA_S / 4  # the loop ran enough to tell the two apart
    assert burnt - slept == pytest.approx(got, abs=0.1)
    assert "Client CPU time (s)" in capsys.readouterr().out
