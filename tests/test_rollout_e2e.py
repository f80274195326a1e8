"""End to end: a gateway rolls out from one `carousel serve --backend sim` process to another.

Issue 41's check on live traffic: the two arms are separate sim processes (upstream arms),
one slowed by a larger `--sim-time-scale`. A 3x slower candidate is rolled back by its TTFT
guardrail; with the speeds swapped the candidate wins on TTFT and is promoted.

The rollout block is sized so a decision needs tens of requests, not thousands (why the
earlier attempt with the example's block never decided in 80 s): steps [50, 100] (the
candidate gets half the traffic at once, and one advance is the promotion), a *paired* TTFT
p50 guardrail rather than a p99 one (a tail guardrail scores no candidate request before the
baseline has 500 samples in the step, gateway/rollout/evidence.py), and a small
`min_requests`. The requests stream: an upstream arm learns a request's TTFT only from a
streamed reply, so unstreamed traffic gives the TTFT tests no samples at all.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_process import carousel_serve

#: the baseline's and the 3x slower arm's `--sim-time-scale`
FAST, SLOW = 5.0, 15.0
DEADLINE_S = 40.0
CONCURRENCY = 4


def _sim_args(time_scale: float) -> list[str]:
    return ["--backend", "sim", "--served-model-name", "sim", "--sim-time-scale", str(time_scale)]


ROLLOUT_YAML = """\
served_model_name: sim
arms:
  - name: baseline
    upstream: {{base_urls: ["{baseline}/v1"], model: sim}}
  - name: candidate
    upstream: {{base_urls: ["{candidate}/v1"], model: sim}}
rollout:
  baseline: baseline
  candidate: candidate
  steps: [50, 100]
  metric: ttft_p50
  guardrails: {{error_rate: 0.05, ttft_p50: 0.10}}
  min_requests: 20
  alpha: 0.05
"""


async def _drive(url: str, deadline_s: float) -> tuple[dict[str, Any], int]:
    """Streamed chat requests from CONCURRENCY users until the rollout is final or the
    deadline passes; the last status and the number of requests sent."""
    sent = 0
    done = asyncio.Event()
    status: dict[str, Any] = {}

    async def user(client: httpx.AsyncClient, index: int) -> None:
        nonlocal sent
        while not done.is_set():
            body = {
                "model": "sim",
                "messages": [{"role": "user", "content": f"hello {index} {sent}"}],
                "max_tokens": 8,
                "stream": True,
            }
            sent += 1
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for _ in reply.aiter_lines():
                    pass

    async def watch(client: httpx.AsyncClient) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            status.update((await client.get(f"{url}/admin/rollout")).json())
            if status["status"] in ("rolled_back", "promoted"):
                break
            await asyncio.sleep(0.5)
        done.set()

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(watch(client), *(user(client, i) for i in range(CONCURRENCY)))
    return status, sent


def _rollout(tmp_path: Path, baseline_scale: float, candidate_scale: float) -> dict[str, Any]:
    """Run the rollout between two sim processes under load; its final status."""
    with ExitStack() as stack:
        baseline = stack.enter_context(
            carousel_serve(_sim_args(baseline_scale), tmp_path, "baseline")
        )
        candidate = stack.enter_context(
            carousel_serve(_sim_args(candidate_scale), tmp_path, "candidate")
        )
        config = tmp_path / "rollout.yaml"
        config.write_text(ROLLOUT_YAML.format(baseline=baseline, candidate=candidate))
        gateway = stack.enter_context(
            carousel_serve(["--config", str(config)], tmp_path, "gateway")
        )
        began = time.monotonic()
        status, sent = asyncio.run(_drive(gateway, DEADLINE_S))
        print(f"{status['status']} after {sent} requests, {time.monotonic() - began:.1f} s")
        return status


@pytest.mark.slow
def test_slower_candidate_is_rolled_back(tmp_path: Path) -> None:
    status = _rollout(tmp_path, FAST, SLOW)
    assert status["status"] == "rolled_back", status
    decision = status["decisions"][-1]
    assert decision["kind"] == "rollback"
    assert decision["reason"] == "guardrail_ttft_p50"
    assert status["candidate_share"] == 0


@pytest.mark.slow
def test_faster_candidate_is_promoted(tmp_path: Path) -> None:
    status = _rollout(tmp_path, SLOW, FAST)
    assert status["status"] == "promoted", status
    kinds = [d["kind"] for d in status["decisions"]]
    assert kinds == ["advance"], status["decisions"]
    assert status["decisions"][0]["reason"] == "target"
    assert status["candidate_share"] == 100
