"""`carousel ab report` on a live split: arms compared at unequal loads per engine are
confounded, and the record's verdict resamples users, the unit a split assigns by."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.ab_load import engines_of, load_entry
from bench.verdict import METRICS_BY_KEY, RunSample, compare_runs
from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, serve_app, sim_arm, start_server
from tests.test_ab_report import run


def test_engines_come_from_the_arms_device_groups() -> None:
    info = [
        {"model": "m", "arm": "a", "device_group": "upstream:http://x/v1,http://y/v1"},
        {"model": "m", "arm": "b", "device_group": "local"},
    ]
    assert engines_of(info, "m", "a") == 2
    assert engines_of(info, "m", "b") == 1
    assert engines_of(info, "m", "c") is None


def test_unequal_loads_per_engine_are_confounded_and_equal_ones_are_not() -> None:
    one = {"a": 1, "b": 1}
    assert load_entry("a", "b", {"a": 500, "b": 500}, one)["confounded"] is False
    assert load_entry("a", "b", {"a": 530, "b": 470}, one)["confounded"] is False  # noise
    skewed = load_entry("a", "b", {"a": 900, "b": 100}, one)
    assert skewed["confounded"] is True and skewed["ratio"] == pytest.approx(9)
    assert "control arm" in skewed["text"]
    pools = load_entry("a", "b", {"a": 900, "b": 100}, {"a": 9, "b": 1})
    assert pools["confounded"] is True  # 100 requests an engine, but a pool spreads them
    assert "pools of different sizes" in pools["text"]
    assert load_entry("a", "b", {"a": 900, "b": 100}, {"a": None, "b": 1})["confounded"] is None


def _clustered_runs(
    rng: np.random.Generator, users: int, requests_per_user: int
) -> tuple[RunSample, RunSample, np.ndarray, np.ndarray]:
    """Identical arms, each with its own `users`, whose latencies share a log-normal user
    factor (sd 0.3) on top of per-request noise (sd 0.5)."""
    runs, owners = [], []
    for _ in range(2):
        factor = np.repeat(rng.lognormal(0, 0.3, users), requests_per_user)
        e2e = rng.lognormal(np.log(500), 0.5, users * requests_per_user) * factor
        n = e2e.size
        nan, empty = np.full(n, np.nan), np.zeros(0)
        runs.append(RunSample(nan, nan, e2e, np.zeros(n), nan, empty, empty.astype(int), None))
        owners.append(np.repeat(np.arange(users), requests_per_user))
    return runs[0], runs[1], owners[0], owners[1]


def test_resampling_users_keeps_identical_arms_at_the_nominal_rate() -> None:
    """Known answer: the arms do not differ. Resampling requests calls a difference far more
    often than 5% when a user's requests move together; resampling users does not."""
    rng = np.random.default_rng(12)
    spec = [METRICS_BY_KEY["e2e_p50"]]
    by_request = by_user = 0
    trials = 120
    for _ in range(trials):
        base, arm, base_users, arm_users = _clustered_runs(rng, 20, 40)
        common = {"slo_active": False, "rng": rng, "num_resamples": 300, "paired": False}
        flat = compare_runs("a", [base], "b", [arm], metrics=spec, simultaneous=True, **common)
        users = compare_runs(
            "a", [base], "b", [arm], metrics=spec, clusters=(base_users, arm_users), **common
        )
        by_request += bool(flat[0]["significant"])
        by_user += bool(users[0]["significant"])
        assert "over users" in users[0]["method"]
    assert by_request / trials > 0.3
    assert by_user / trials <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / trials)


def _live_split(
    tmp_path: Path,
    weights: dict[str, float],
    capsys: pytest.CaptureFixture[str],
    *pairs: tuple[str, str],
) -> list[dict[str, Any]]:
    """Identical paced sim engines, one per arm, behind a gateway split by `weights`; 400
    requests from 400 users, 8 at a time; `carousel ab report --record` for each pair."""
    record = tmp_path / "traffic.jsonl"
    with ExitStack() as stack:
        upstream = [
            {
                "name": name,
                "weight": weight,
                "upstream": {
                    "base_urls": [start_server(stack, sim_arm(time_scale=1.0)).v1],
                    "model": SIM_MODEL,
                },
            }
            for name, weight in weights.items()
        ]
        settings = Settings(
            backend="sim",
            served_model_name="m",
            arms=upstream,  # type: ignore[arg-type]
            record_traffic=str(record),
        )
        url = stack.enter_context(serve_app(create_app(settings)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        with httpx.Client(base_url=url, timeout=30) as client:

            def send(i: int) -> int:
                reply = client.post("/v1/chat/completions", json=body | {"user": f"u{i}"})
                return reply.status_code

            with ThreadPoolExecutor(8) as pool:
                assert set(pool.map(send, range(400))) == {200}
        time.sleep(0.5)  # the record's writer thread flushes
        reports = []
        for base, arm in pairs:
            out = tmp_path / f"{base}-{arm}"
            flags = ["--arm", base, "--arm", arm, "--out", str(out)]
            code, text = run("--url", url, "--record", str(record), *flags, capsys=capsys)
            assert code == 0, text
            reports.append(json.loads((out / "ab_report.json").read_text()))
    return reports


#: a change of p50 e2e this large is material; identical arms at equal load stay inside it
#: (whether they read "no difference" at alpha is a rate, checked on simulated data above:
#: asserted on one live run it would fail one run in twenty)
MATERIAL = 0.2


def e2e_p50_change(report: dict[str, Any]) -> float:
    """The arm's relative change of p50 e2e against the baseline, from users' resamples."""
    (entry,) = [e for e in report["comparison"] if e["metric"] == "e2e_p50"]
    assert "over users" in entry["method"]
    return float(entry["diff"])


def test_identical_arms_at_50_50_read_no_difference(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:  # fmt: skip
    (report,) = _live_split(tmp_path, {"a": 50, "b": 50}, capsys, ("a", "b"))
    (load,) = report["load"]
    assert load["confounded"] is False, load
    assert abs(e2e_p50_change(report)) < MATERIAL


def test_a_10_90_split_reads_no_difference_against_its_control_and_flags_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The candidate at 10% against a control of the baseline's engine at 10% (production
    carries the other 80%): identical engines read no difference; against production's 80%,
    the pair is confounded by load."""
    weights = {"production": 80, "control": 10, "candidate": 10}
    pairs = [("control", "candidate"), ("production", "candidate")]
    report, against_production = _live_split(tmp_path, weights, capsys, *pairs)
    (load,) = report["load"]
    assert load["confounded"] is False, load
    assert abs(e2e_p50_change(report)) < MATERIAL
    (load,) = against_production["load"]
    assert load["confounded"] is True and load["ratio"] > 4, load
    assert e2e_p50_change(against_production) < -MATERIAL  # the lighter engine looks faster
