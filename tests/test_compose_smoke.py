"""scripts/compose-smoke.sh: the compose stack built and run for real in containers.

The smoke runs where docker (with a daemon it reaches) or podman works, and is skipped with
the reason otherwise (CI has neither): it builds the cpu image, starts the gateway, both
engines and Prometheus, sends OpenAI SDK requests through the gateway, checks the per-arm
series in /metrics and Prometheus and the Grafana dashboard's queries, and tears down. Set
CAROUSEL_SMOKE_BREAK (engine-unreachable, arm-missing, unhealthy) to watch it fail.

The smoke's checks (scripts/compose_smoke.py) also run without containers, on every test run:
against the compose services started as loopback processes with the sim backend (the
`stack` fixture of tests/test_compose.py), where they must pass, and fail when an arm gets
no traffic or the gateway's counts disagree with what was sent; the dashboard check against
live scrapes of those services and a stand-in Prometheus (which answers every query), where it
must pass and leave the rollout panels alone (the stack runs no rollout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.conftest import serve_app
from tests.test_compose import ARMS, MODEL, LocalService, stack  # noqa: F401  (a fixture, used below)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compose-smoke.sh"
CHECKS = ROOT / "scripts" / "compose_smoke.py"
#: the Carousel services Prometheus scrapes (deploy/prometheus/prometheus.yml)
JOBS = ("gateway", "engine-orca", "engine-static")
#: the whole smoke: builds (cached after the first), three model loads on two cores, checks
SMOKE_TIMEOUT_S = 3000


def working_engine() -> tuple[str | None, str]:
    """The container engine the smoke would use, or None and why there is none."""
    reasons = []
    for engine, probe_s in (("docker", 20), ("podman", 60)):
        binary = shutil.which(engine)
        if binary is None:
            reasons.append(f"no {engine}")
            continue
        try:
            done = subprocess.run([binary, "info"], capture_output=True, text=True, timeout=probe_s)
        except subprocess.TimeoutExpired:
            reasons.append(f"`{engine} info` hangs")
            continue
        if done.returncode == 0:
            return engine, ""
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        reasons.append(f"`{engine} info` fails: {last}")
    return None, "; ".join(reasons)


def run_checks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKS), *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )


@pytest.mark.timeout(400)
def test_smoke_checks_on_the_compose_services_run_locally(
    stack: dict[str, LocalService],  # noqa: F811
    tmp_path: Path,
) -> None:
    gateway = stack["gateway"].url
    record = tmp_path / "traffic.json"
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text(httpx.get(f"{gateway}/metrics", timeout=10).text)

    # nothing sent to `static` yet: the metrics check names the missing arm
    done = run_checks(
        "traffic", "--gateway", gateway, "--record", str(record), "--skip-arm", "static"
    )
    assert done.returncode == 0, done.stderr
    assert "check: chat via arm orca" in done.stdout and "arm static" not in done.stdout
    after.write_text(httpx.get(f"{gateway}/metrics", timeout=10).text)
    metrics = ("metrics", "--record", str(record), "--scrape", f"gateway={after}")
    done = run_checks(*metrics, "--baseline", str(before))
    assert done.returncode == 1
    assert "FAIL: arm 'static' is missing from the gateway's /metrics" in done.stderr

    # both arms, pinned and sticky: every check passes, counted from a fresh baseline
    before.write_text(after.read_text())
    done = run_checks("traffic", "--gateway", gateway, "--record", str(record))
    assert done.returncode == 0, done.stderr
    for arm in ("orca", "static"):
        assert f"check: chat via arm {arm}" in done.stdout
        assert f"check: streamed chat via arm {arm}" in done.stdout
        assert f"(no header) served by arm {arm} 3 times out of 3" in done.stdout
    after.write_text(httpx.get(f"{gateway}/metrics", timeout=10).text)
    done = run_checks(*metrics, "--baseline", str(before))
    assert done.returncode == 0, done.stderr
    assert "check: gateway /metrics arm static: 5 requests (sent 5)" in done.stdout

    # a count the gateway did not make: the check compares, it does not just look for series
    sent = json.loads(record.read_text())
    sent["served"]["orca"] += 1
    record.write_text(json.dumps(sent))
    done = run_checks(*metrics, "--baseline", str(before))
    assert done.returncode == 1
    assert "grew by 5, but the smoke sent that arm 6 requests" in done.stderr


def stand_in_prometheus() -> FastAPI:
    """Answers every query with a series per arm and per Carousel job, and the served model
    as the `model` label's values: the dashboard check's own logic is what is under test."""
    app = FastAPI()
    series = [{"metric": {"arm": a, "job": j}, "value": [0, "1"]} for a in ARMS for j in JOBS]

    @app.get("/api/v1/query")
    def query(query: str) -> dict[str, Any]:
        return {"status": "success", "data": {"resultType": "vector", "result": series}}

    @app.get("/api/v1/label/{label}/values")
    def values(label: str) -> dict[str, Any]:
        return {"status": "success", "data": [MODEL]}

    return app


@pytest.mark.timeout(400)
def test_the_dashboard_check_reads_live_scrapes_and_leaves_rollout_panels_without_a_rollout(
    stack: dict[str, LocalService],  # noqa: F811
    tmp_path: Path,
) -> None:
    for arm in ARMS:  # every arm and engine has streamed something (TTFT needs a stream)
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True,
        }  # fmt: skip
        headers = {"X-Carousel-Arm": arm}
        reply = httpx.post(
            f"{stack['gateway'].url}/v1/chat/completions", json=body, headers=headers, timeout=60
        )
        assert reply.status_code == 200, reply.text
    scrapes = []
    for job in JOBS:
        path = tmp_path / f"{job}.txt"
        path.write_text(httpx.get(f"{stack[job].url}/metrics", timeout=10).text)
        scrapes += ["--scrape", f"{job}={path}"]
    with serve_app(stand_in_prometheus(), ready_path=None) as prometheus:
        done = run_checks("dashboard", "--prometheus", prometheus, *scrapes)
    assert done.returncode == 0, done.stderr
    assert "3 rollout panels not checked live: gateway.yaml has no `rollout:`" in done.stdout


def slow_prometheus(unfilled_answers: int, never: str | None = None) -> FastAPI:
    """A stand-in Prometheus that answers each query with no series its first
    `unfilled_answers` times (as a `rate()` has none until two scrapes fall in its window),
    and never any for the queries that contain `never`; then a series per arm and job."""
    app = FastAPI()
    series = [{"metric": {"arm": a, "job": j}, "value": [0, "1"]} for a in ARMS for j in JOBS]
    asked: dict[str, int] = {}

    @app.get("/api/v1/query")
    def query(query: str) -> dict[str, Any]:
        asked[query] = asked.get(query, 0) + 1
        filled = asked[query] > unfilled_answers and not (never and never in query)
        result = series if filled else []
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    @app.get("/api/v1/label/{label}/values")
    def values(label: str) -> dict[str, Any]:
        return {"status": "success", "data": [MODEL]}

    return app


def dashboard_scrapes(tmp_path: Path) -> list[str]:
    """`--scrape job=path` arguments whose files name every Carousel metric the dashboard's
    queries read (the check wants each in a live scrape of its job)."""
    text = (ROOT / "deploy" / "grafana" / "dashboards" / "carousel-ab.json").read_text()
    names = sorted(set(re.findall(r"\bcarousel_[a-z0-9_]+", text)))
    args = []
    for job in JOBS:
        path = tmp_path / f"{job}.txt"
        path.write_text("".join(f"{name} 1\n" for name in names))
        args += ["--scrape", f"{job}={path}"]
    return args


def test_the_dashboard_check_waits_for_each_panels_series(tmp_path: Path) -> None:
    """Right after the traffic Prometheus has no series yet for the rate() panels: the check
    polls until every panel is filled instead of failing on the first answer."""
    with serve_app(slow_prometheus(unfilled_answers=1), ready_path=None) as prometheus:
        done = run_checks(
            "dashboard", "--prometheus", prometheus, "--timeout", "60", *dashboard_scrapes(tmp_path)
        )
    assert done.returncode == 0, done.stderr
    assert "check: dashboard carousel-ab.json" in done.stdout


def test_the_dashboard_check_names_the_panel_still_unfilled_at_its_deadline(
    tmp_path: Path,
) -> None:
    with serve_app(slow_prometheus(0, never='job=~"engine-.*"'), ready_path=None) as prometheus:
        done = run_checks(
            "dashboard", "--prometheus", prometheus, "--timeout", "1", *dashboard_scrapes(tmp_path)
        )
    assert done.returncode == 1
    assert (
        "FAIL: panel 'Batch size per iteration (mean, p95)': Prometheus has series for [], "
        "not each of ['engine-orca', 'engine-static']"
    ) in done.stderr
    assert "still, 1 s after the check began" in done.stderr


def test_bad_break_knob_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "CAROUSEL_SMOKE_BREAK": "everything", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "CAROUSEL_SMOKE_BREAK=everything" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 120)
def test_compose_smoke_passes_end_to_end(tmp_path: Path) -> None:
    engine, why = working_engine()
    if engine is None:
        pytest.skip(f"no container engine to run the compose stack with ({why})")
    project = f"carousel-smoke-pytest-{os.getpid()}"
    out = tmp_path / "out"
    env = {
        **os.environ,
        "CAROUSEL_SMOKE_ENGINE": engine,
        "CAROUSEL_SMOKE_PROJECT": project,
        "CAROUSEL_SMOKE_OUT": str(out),
        "PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert done.returncode == 0, f"{done.stderr[-6000:]}\n--- summary:\n{summary}"
    for line in (
        "engine-orca: healthy",
        "engine-static: healthy",
        "gateway: healthy",
        "prometheus: healthy",
        "check: chat via arm orca",
        "check: chat via arm static",
        "check: streamed chat via arm orca",
        "check: streamed chat via arm static",
        "(no header) served by arm orca",
        "(no header) served by arm static",
        "check: gateway /metrics arm orca",
        "check: gateway /metrics arm static",
        "check: prometheus targets up",
        "check: dashboard",
        f"teardown: no container, pod, network or volume of project {project} left",
        "compose smoke: PASS",
    ):
        assert line in summary, f"{line!r} missing from the summary:\n{summary}"
    # nothing of the project is left, as the engine itself sees it
    label = f"label=com.docker.compose.project={project}"
    left = subprocess.run(
        [engine, "ps", "-a", "-q", "--filter", label],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert left.returncode == 0 and not left.stdout.strip(), left.stdout


READY = json.dumps(
    {"module": "/opt/carousel-kernels/ab/m.so", "isa": "avx512", "event": "cpu_kernels_ready"}
)
BUILDING = '{"phase": "building_kernels", "event": "cpu_kernels_building", "level": "info"}'
NO_COMPILER = '{"error": "no compiler", "event": "cpu_kernels_build_failed", "level": "warning"}'


@pytest.mark.parametrize(
    ("lines", "verdict"),
    [
        ([READY], "check: engine-orca runs the CPU kernels built into the image (isa avx512)"),
        ([BUILDING, READY], "FAIL: engine-orca: the CPU kernels were built at start-up"),
        ([NO_COMPILER], "FAIL: engine-orca: the CPU kernels are not running ({"),
        (["plain text only"], "FAIL: engine-orca: the CPU kernels are not running (no cpu_"),
    ],
)
def test_kernels_ready_needs_the_image_built_kernels(
    tmp_path: Path, lines: list[str], verdict: str
) -> None:
    log = tmp_path / "engine.log"
    log.write_text("\n".join(["Started server process [1]", *lines, "arm_ready"]) + "\n")
    done = run_checks("kernels-ready", "--service", "engine-orca", str(log))
    assert verdict in done.stdout + done.stderr
    assert done.returncode == (0 if verdict.startswith("check:") else 1)
