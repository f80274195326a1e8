"""End to end: a gateway rolls out from one `carousel serve --backend sim` process to another.

Issue 41's check on live traffic: the two arms are separate sim processes (upstream arms),
one slowed by a larger `--sim-time-scale`. A 3x slower candidate is rolled back by its TTFT
guardrail; with the speeds swapped the candidate wins on TTFT and is promoted.

The rollout block is sized so a decision needs tens of requests, not thousands (why the
earlier attempt with the example's block never decided in 80 s): steps [50, 100] (the
candidate gets half the traffic at once, and one advance is the promotion), a *paired* TTFT
p50 guardrail rather than a p99 one (a tail guardrail scores no candidate request before the
baseline has 500 samples in the step, gateway/rollout/evidence.py), and a small
`min_requests`. The load is `carousel bench` (this checkout's, as a process), as the issue asks:
its requests stream, and an upstream arm learns a request's TTFT only from a streamed reply, so
unstreamed traffic would give the TTFT tests no samples at all. The bench is stopped (SIGINT,
its clean stop) once the rollout is final.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_process import carousel_process, carousel_serve, carousel_serves, stop

#: the baseline's and the 3x slower arm's `--sim-time-scale`
FAST, SLOW = 5.0, 15.0
DEADLINE_S = 40.0
CONCURRENCY = 4
#: bench's --num-requests: an upper bound, the bench is stopped at the decision
MAX_REQUESTS = 2000


def sim_args(time_scale: float) -> list[str]:
    return ["--backend", "sim", "--served-model-name", "sim", "--sim-time-scale", str(time_scale)]


ROLLOUT_YAML = """\
served_model_name: {model}
arms:
  - name: baseline
    upstream: {{base_urls: ["{baseline}/v1"], model: sim}}
  - name: candidate
    upstream: {{base_urls: ["{candidate}/v1"], model: sim}}
rollout:
  baseline: baseline
  candidate: candidate
  steps: {steps}
  metric: ttft_p50
  guardrails: {{error_rate: 0.05, ttft_p50: 0.10}}
  min_requests: 20
  alpha: 0.05
"""


def rollout_yaml(
    baseline: str, candidate: str, model: str = "sim", steps: str = "[50, 100]"
) -> str:
    """A gateway config rolling out from the upstream `baseline` to `candidate` (sim servers)."""
    return ROLLOUT_YAML.format(baseline=baseline, candidate=candidate, model=model, steps=steps)


def rollout_status(url: str) -> dict[str, Any]:
    """The gateway's `/admin/rollout`."""
    return httpx.get(f"{url}/admin/rollout", timeout=10).json()  # type: ignore[no-any-return]


def bench_load(url: str, model: str, folder: Path, name: str = "bench") -> list[str]:
    """`carousel bench` arguments: streamed chat requests to `url` from CONCURRENCY users, more
    than any rollout here needs (the test stops it, by SIGINT, once the rollout is final)."""
    return [
        "bench", "--url", f"{url}/v1", "--model", model,
        "--num-requests", str(MAX_REQUESTS), "--max-concurrency", str(CONCURRENCY),
        "--input-len", "fixed:4", "--output-len", "fixed:8", "--warmups", "0",
        "--no-trace", "--no-progress", "--out", str(folder / name),
    ]  # fmt: skip


def _drive(url: str, folder: Path, deadline_s: float) -> dict[str, Any]:
    """`carousel bench` load on the gateway until the rollout is final or the deadline passes;
    the last status."""
    with carousel_process(bench_load(url, "sim", folder), folder, "bench") as bench:
        status = _watch(url, bench, deadline_s)
        stop(bench)  # SIGINT: bench's clean stop, its in-flight requests cancelled
    bench_log = (folder / "bench.log").read_text()
    assert bench.returncode in (0, 130), bench_log  # 130: stopped at the decision
    assert "Requests ok / failed" in bench_log, bench_log  # its report covers what it sent
    return status


def _watch(url: str, bench: subprocess.Popen[bytes], deadline_s: float) -> dict[str, Any]:
    """The rollout's status, polled until it is final, bench ends or the deadline passes."""
    end = time.monotonic() + deadline_s
    while True:
        status = rollout_status(url)
        final = status["status"] in ("rolled_back", "promoted")
        if final or bench.poll() is not None or time.monotonic() > end:
            return status
        time.sleep(0.5)


def _rollout(tmp_path: Path, baseline_scale: float, candidate_scale: float) -> dict[str, Any]:
    """Run the rollout between two sim processes under load; its final status."""
    arms = [(sim_args(baseline_scale), "baseline"), (sim_args(candidate_scale), "candidate")]
    with carousel_serves(arms, tmp_path) as (baseline, candidate):
        config = tmp_path / "rollout.yaml"
        config.write_text(rollout_yaml(baseline, candidate))
        with carousel_serve(["--config", str(config)], tmp_path, "gateway") as gateway:
            began = time.monotonic()
            status = _drive(gateway, tmp_path, DEADLINE_S)
            took = time.monotonic() - began
    n = status["decisions"][-1]["n"] if status["decisions"] else status["n"]
    print(f"{status['status']} at n={n} (requests per arm in the step), {took:.1f} s of load")
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
