"""End to end: a gateway rolls out from one `carousel serve --backend sim` process to another.

Issue 41's check on live traffic: the two arms are separate sim processes (upstream arms),
one slowed by a larger `--sim-time-scale`. A 3x slower candidate is rolled back by its TTFT
guardrail; with the speeds swapped the candidate wins on TTFT and is promoted.

The rollout block is sized so a decision needs tens of requests, not thousands (why the
earlier attempt with the example's block never decided in 80 s): one request a unit
(`requests_per_unit: 1`; the default deals requests into 50 open units of 5), steps [50, 100] (the
candidate gets half the traffic at once, and one advance is the promotion), a *paired* TTFT
p50 guardrail rather than a p99 one (a tail guardrail scores no candidate request before the
baseline has 500 samples in the step, gateway/rollout/evidence.py), and a small
`min_requests`. The load is `carousel bench` (this checkout's, as a process), as the issue asks:
its requests stream, and an upstream arm learns a request's TTFT only from a streamed reply, so
unstreamed traffic would give the TTFT tests no samples at all. The bench is stopped (SIGINT,
its clean stop) once the rollout is final.

The default steps (5, 25, 50, 100) run in the documented topology (docs/rollout.md: a control
engine of the baseline's config beside the candidate's), in one process for speed: a faster
candidate is promoted through every step, a candidate that stops answering is rolled back at
the first.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, serve_app, sim_arm, start_server
from tests.serve_process import carousel_process, carousel_serve, carousel_serves, free_port, stop

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
    upstream: {{base_urls: ["{candidate}/v1"], model: sim}}{control_arm}
rollout:
  baseline: baseline
  candidate: candidate{control}
  steps: {steps}
  metric: ttft_p50
  guardrails: {{error_rate: 0.05, ttft_p50: 0.10}}
  min_requests: 20
  requests_per_unit: 1
  alpha: 0.05
"""


def rollout_yaml(
    baseline: str,
    candidate: str,
    model: str = "sim",
    steps: str = "[50, 100]",
    control: str | None = None,
) -> str:
    """A gateway config rolling out from the upstream `baseline` to `candidate` (sim servers),
    compared with `control` (a server like the baseline's) when given."""
    control_arm = (
        f'\n  - name: control\n    upstream: {{base_urls: ["{control}/v1"], model: sim}}'
        if control
        else ""
    )
    return ROLLOUT_YAML.format(
        baseline=baseline,
        candidate=candidate,
        model=model,
        steps=steps,
        control_arm=control_arm,
        control="\n  control: control" if control else "",
    )


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


def _stream_chat(client: httpx.Client, user: str | None) -> int:
    """One streamed chat request through the gateway; its status."""
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    if user is not None:
        body["user"] = user
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        for _ in reply.iter_bytes():
            pass
        return reply.status_code


def _drive_in_process(url: str, users: int | None, deadline_s: float) -> dict[str, Any]:
    """Eight clients in a closed loop (each request from one of `users` users, or none)
    until the rollout is final or the deadline passes; the last status."""
    end = time.monotonic() + deadline_s
    done = threading.Event()

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set() and time.monotonic() < end:
                user = None if users is None else f"user-{rng.randrange(users)}"
                _stream_chat(client, user)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        while time.monotonic() < end:
            status = rollout_status(url)
            if status["status"] in ("rolled_back", "promoted"):
                return status
            time.sleep(0.2)
        return rollout_status(url)
    finally:
        done.set()
        for thread in threads:
            thread.join()


def _control_rollout(
    urls: dict[str, str], assignment: str, users: int | None, deadline_s: float = 90.0
) -> dict[str, Any]:
    """The documented topology in one process: baseline, control and candidate engines as
    upstream arms, the default steps; the final status."""
    settings = Settings(
        backend="sim",
        served_model_name="m",
        arms=[  # type: ignore[list-item]
            {"name": name, "upstream": {"base_urls": [url], "model": SIM_MODEL, "retries": 0}}
            for name, url in urls.items()
        ],
        rollout={  # type: ignore[arg-type]
            "baseline": "baseline",
            "control": "control",
            "candidate": "candidate",
            "assignment": assignment,
            "metric": "ttft_p50",
            "guardrails": {"error_rate": 0.05, "ttft_p50": 0.10},
            "min_requests": 20,
            "requests_per_unit": 1,
        },
    )
    with ExitStack() as stack:
        url = stack.enter_context(serve_app(create_app(settings)))
        return _drive_in_process(url, users, deadline_s)


@pytest.mark.serial  # a decision through four steps inside a 90 s deadline
def test_a_faster_candidate_is_promoted_through_the_default_steps_against_its_control() -> None:
    """Paced sim engines (their step time grows with the batch, so latency with load): the
    candidate's engine runs 3x faster than the baseline's and the control's, each compared
    at the candidate's share; per-request assignment."""
    with ExitStack() as stack:
        slow = {n: start_server(stack, sim_arm(time_scale=3.0)).v1 for n in ("baseline", "control")}
        fast = start_server(stack, sim_arm(time_scale=1.0)).v1
        status = _control_rollout({**slow, "candidate": fast}, "request", None)
    assert status["status"] == "promoted", status
    assert [d["kind"] for d in status["decisions"]] == ["advance"] * 3, status["decisions"]
    assert [d["share"] for d in status["decisions"]] == [5, 25, 50]
    assert status["compared"] == ["candidate", "control"]
    assert status["assignment"] == "request" and status["unit"].startswith("a block's first 1")
    print(f"promoted after {[d['n'] for d in status['decisions']]}")


def test_a_candidate_that_stops_answering_is_rolled_back_at_the_first_step() -> None:
    """The candidate's URL has nothing behind it: every request the split draws for it fails
    (and is served by another arm), and it is rolled back at 5%, with users as the unit."""
    with ExitStack() as stack:
        live = {n: start_server(stack, sim_arm(time_scale=1.0)).v1 for n in ("baseline", "control")}
        dead = f"http://127.0.0.1:{free_port()}/v1"
        status = _control_rollout({**live, "candidate": dead}, "user", 400, deadline_s=60.0)
    assert status["status"] == "rolled_back", status
    decision = status["decisions"][-1]
    assert decision["kind"] == "rollback" and decision["step"] == 0
    assert decision["reason"] in ("candidate_failing", "guardrail_error_rate")
    print(f"rolled back by {decision['reason']} after {decision['n']}")
