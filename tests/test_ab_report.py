"""`carousel ab report`: the verdict of a live split from histograms, a traffic record or
Prometheus, the `carousel_arm_info` gauge, and the plain "confounded" decision."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.parser import text_string_to_metric_families

from bench.ab import (
    CONFOUNDED_OVERLAP,
    baseline_first,
    confounding,
    histogram_verdict,
    interval_overlap,
    sample_overlap,
)
from bench.cli import register
from bench.metrics import Slo
from bench.prom import E2E, TTFT, Histogram, Scrape, parse_duration, parse_exposition
from bench.stats import histogram_share_below
from gateway.app import create_app
from gateway.obs.metrics import ArmInfo, GatewayMetrics, local_device_group, upstream_device_group
from gateway.obs.traffic_record import TrafficEntry, TrafficRecorder
from gateway.settings.load import Settings
from tests.conftest import serve_app

MODEL = "ab-model"
BUCKETS = np.array([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, np.inf])


def ab_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="carousel")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["ab", "report", *argv])


def run(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code, and stdout + stderr."""
    args = ab_args(*argv)
    code = int(args.func(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_arm_info_has_no_series_until_wired_then_one_per_arm() -> None:
    assert b"carousel_arm_info" not in GatewayMetrics().render()
    infos = [
        ArmInfo(MODEL, "orca", "local", local_device_group()),
        ArmInfo(MODEL, "vllm", "upstream", upstream_device_group("http://gpu:8001/v1/")),
    ]
    text = GatewayMetrics(arm_info=lambda: infos).render().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "carousel_arm_info"]
    labels = [(s.labels, s.value) for s in family.samples]
    group = "local"  # no hostname or pid in a public label
    assert labels == [
        ({"model": MODEL, "arm": "orca", "kind": "local", "device_group": group}, 1.0),
        ({"model": MODEL, "arm": "vllm", "kind": "upstream",
          "device_group": "upstream:http://gpu:8001/v1"}, 1.0),
    ]  # fmt: skip
    assert parse_exposition(text).arm_info[1]["device_group"] == "upstream:http://gpu:8001/v1"


def test_durations_and_histogram_shares() -> None:
    assert [parse_duration(t) for t in ("90s", "15m", "1h", "2d", "30")] == [
        90, 900, 3600, 172800, 30
    ]  # fmt: skip
    with pytest.raises(ValueError):
        parse_duration("an hour")
    bounds, counts = np.array([1.0, 2.0, np.inf]), np.array([10, 20, 10])
    assert histogram_share_below(bounds, counts, 1.5) == pytest.approx(20 / 40)
    assert histogram_share_below(bounds, counts, 5.0) == pytest.approx(30 / 40)


def histogram_of(values: np.ndarray) -> Histogram:
    index = np.searchsorted(BUCKETS, values, side="left")
    return Histogram(BUCKETS, np.bincount(index, minlength=BUCKETS.size))


def window_of(base: np.ndarray, arm: np.ndarray) -> Scrape:
    scrape = Scrape(0.0)
    for family in (TTFT, E2E):
        scrape.histograms[family] = {
            (MODEL, "a"): histogram_of(base),
            (MODEL, "b"): histogram_of(arm),
        }
    return scrape


def test_histograms_find_a_real_shift_and_stay_quiet_without_one() -> None:
    quiet = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        same = window_of(rng.lognormal(-1, 0.6, 1500), rng.lognormal(-1, 0.6, 1500))
        entries, _ = histogram_verdict(same, MODEL, "a", "b", Slo(), rng, 300)
        quiet += next(e for e in entries if e["metric"] == "e2e_p50")["significant"] is False
    assert quiet >= 90
    rng = np.random.default_rng(7)
    shifted = window_of(rng.lognormal(-1, 0.6, 3000), 1.3 * rng.lognormal(-1, 0.6, 3000))
    entries, notes = histogram_verdict(shifted, MODEL, "a", "b", Slo(ttft_ms=500), rng, 500)
    by_key = {e["metric"]: e for e in entries}
    assert by_key["e2e_p50"]["significant"] is True and by_key["e2e_p50"]["better"] is False
    assert 0.1 < by_key["e2e_p50"]["diff"] < 0.5
    assert by_key["goodput"]["significant"] is True and by_key["goodput"]["diff_abs"] < 0
    assert by_key["itl_p99"]["sentence"].startswith("no comparison")  # no ITL histogram here
    assert any("TPOT" in n for n in notes)


def test_overlaps_have_known_answers() -> None:
    a = [(0.0, 2.0), (1.0, 3.0), (10.0, 11.0)]  # busy [0, 3] and [10, 11]
    b = [(2.0, 4.0), (20.0, 21.0)]  # busy [2, 4] and [20, 21]
    assert interval_overlap(a, b) == pytest.approx(1 / 6)  # both in [2, 3]; either 6 s
    assert interval_overlap(a, []) == 0.0 and interval_overlap([], []) is None
    assert sample_overlap([0, 1, 2, 0, 0], [1, 1, 0, 0, 3]) == pytest.approx(1 / 4)


def test_confounded_is_decided_plainly() -> None:
    entry = confounding("static", "orca", True, "local:h:1", 0.6, True)
    assert entry["confounded"] is True and entry["text"].startswith("CONFOUNDED")
    assert "--replay" in entry["text"]
    quiet = confounding("static", "orca", True, "local:h:1", CONFOUNDED_OVERLAP / 2, True)
    assert quiet["confounded"] is False and "rarely busy" in quiet["text"]
    apart = confounding("orca", "vllm", False, "local:h:1 and upstream:http://x", 0.9, True)
    assert apart["confounded"] is False and "separate devices" in apart["text"]
    assert confounding("a", "b", True, "g", None, True)["text"].startswith("possibly confounded")
    assert confounding("a", "b", None, None, 0.9, True)["confounded"] is None


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    """Two local simulator arms that take real time (about 4 ms an iteration)."""
    arms = [{"name": "static", "scheduler": "static"}, {"name": "orca", "scheduler": "orca"}]
    settings = Settings(backend="sim", served_model_name=MODEL, arms=arms, sim_time_scale=1.0)  # type: ignore[arg-type]
    with serve_app(create_app(settings)) as url:
        yield url


def send(url: str, arm: str, n: int, max_tokens: int = 8) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            reply = client.post(
                f"{url}/v1/chat/completions", json=body, headers={"X-Carousel-Arm": arm}
            )
            assert reply.status_code == 200


def test_live_report_from_the_servers_histograms(
    live: str, capsys: pytest.CaptureFixture[str]
) -> None:
    send(live, "static", 6)
    send(live, "orca", 6)
    code, out = run("--url", live, "--arm", "static", "--arm", "orca", capsys=capsys)
    assert code == 0, out
    assert "since the server started" in out and "orca against static:" in out
    assert "p50 e2e" in out and "p99 TTFT" in out
    # carousel_arm_info names one device group: both are local arms of one process
    assert "possibly confounded: static and orca share one device (local)" in out
    assert "TPOT" in out  # says what /metrics cannot compare


def test_live_window_sees_both_arms_busy_at_once_and_says_confounded(
    live: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    load = [threading.Thread(target=send, args=(live, arm, 12, 60)) for arm in ("static", "orca")]
    for thread in load:
        thread.start()
    time.sleep(0.2)
    code, out = run("--url", live, "--window", "1.5", "--arm", "static", "--arm", "orca",
                    "--out", str(tmp_path), capsys=capsys)  # fmt: skip
    for thread in load:
        thread.join(60)
    assert code == 0, out
    assert "over the 1.5 s between two scrapes" in out
    assert "measuring " in out and "/2 s [" in out and "left]" in out  # the countdown
    assert "CONFOUNDED: static and orca share one device" in out
    report = json.loads((tmp_path / "ab_report.json").read_text())
    (device,) = report["device"]
    assert device["confounded"] is True and device["busy_overlap"] > CONFOUNDED_OVERLAP
    assert (tmp_path / "comparison.png").exists() and (tmp_path / "ab_report.md").exists()


@contextmanager
def serve_fake(app: FastAPI) -> Iterator[str]:
    with serve_app(app, ready_path=None) as url:
        yield url


def metrics_text(device_groups: dict[str, str]) -> str:
    metrics = GatewayMetrics(
        arm_info=lambda: [ArmInfo(MODEL, a, "local", g) for a, g in device_groups.items()]
    )
    return metrics.render().decode()


def write_record(path: Path, faster: float) -> None:
    """Arm a and b served interleaved requests over 40 to 10 s ago; b is `faster` times a."""
    recorder = TrafficRecorder(path)
    rng = np.random.default_rng(3)
    t0 = time.monotonic()
    for i in range(600):
        arm = "ab"[i % 2]
        e2e = float(rng.lognormal(-1, 0.3)) * (faster if arm == "b" else 1.0)
        recorder.record(TrafficEntry(t0 - 40 + i * 0.05, "chat", {"model": MODEL}, arm, model=MODEL,
                                     status=200, prompt_tokens=10, completion_tokens=20,
                                     ttft_s=e2e / 10, e2e_s=e2e))  # fmt: skip
    recorder.close()


def test_record_gives_a_per_request_verdict_and_its_overlap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "traffic.jsonl"
    write_record(path, faster=0.7)
    app = FastAPI()
    app.get("/metrics")(
        lambda: PlainTextResponse(metrics_text({"a": "local:h:1", "b": "local:h:1"}))
    )
    with serve_fake(app) as url:
        code, out = run("--url", url, "--record", str(path), "--slo", "ttft=1s,tpot=50ms",
                        "--out", str(tmp_path / "out"), capsys=capsys)  # fmt: skip
    assert code == 0, out
    report = json.loads((tmp_path / "out" / "ab_report.json").read_text())
    by_key = {e["metric"]: e for e in report["comparison"]}
    assert set(by_key) == {"ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50", "e2e_p99", "goodput"}
    e2e = by_key["e2e_p50"]
    assert e2e["significant"] is True and e2e["better"] is True
    assert e2e["ci95"][0] < -0.3 < e2e["ci95"][1] and "independent" in e2e["method"]
    assert "b lowers p50 e2e by" in out
    (device,) = report["device"]
    assert device["device_group"] == "local:h:1" and device["confounded"] is True  # interleaved
    assert [a["requests"] for a in report["arms"]] == [300, 300]
    code, out = run("--record", str(path), "--since", "25s", "--out", str(tmp_path / "recent"),
                    capsys=capsys)  # fmt: skip
    recent = json.loads((tmp_path / "recent" / "ab_report.json").read_text())
    kept = [a["requests"] for a in recent["arms"]]  # the last 25 s of a 40..10 s-old record
    assert code == 0 and all(0 < n < 300 for n in kept) and abs(kept[0] - kept[1]) <= 1
    assert "unknown whether a and b share a device" in out  # no --url: no carousel_arm_info
    code, out = run("--record", str(path), "--since", "5s", capsys=capsys)
    assert code == 2 and "need two arms" in out


def test_prometheus_window_uses_increase_and_a_range_of_running_gauges(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = np.random.default_rng(0)
    hist = {"a": histogram_of(rng.lognormal(-1, 0.5, 4000)),
            "b": histogram_of(1.5 * rng.lognormal(-1, 0.5, 4000))}  # fmt: skip
    queries: list[dict[str, Any]] = []
    app = FastAPI()

    @app.get("/api/v1/query")
    async def query(request: Request) -> JSONResponse:
        params = dict(request.query_params)
        queries.append(params)
        if params["query"] == "carousel_arm_info":
            result = [{"metric": {"__name__": "carousel_arm_info", "model": MODEL, "arm": a,
                                  "kind": "upstream", "device_group": f"upstream:http://{a}"},
                       "value": [0, "1"]} for a in "ab"]  # fmt: skip
        else:
            assert params["query"].startswith("increase(") and params["query"].endswith("[3600s])")
            result = [
                {"metric": {"model": MODEL, "arm": a, "le": str(le)}, "value": [0, str(c)]}
                for a, h in hist.items()
                for le, c in zip(h.bounds, np.cumsum(h.counts), strict=True)
            ]
        return JSONResponse(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    @app.get("/api/v1/query_range")
    async def query_range(request: Request) -> JSONResponse:
        p = request.query_params
        start, end, step = float(p["start"]), float(p["end"]), float(p["step"])
        times = np.arange(start, end + step / 2, step)
        result = [{"metric": {"arm": a, "model": MODEL}, "values": [[t, "1"] for t in times]}
                  for a in "ab"]  # fmt: skip
        return JSONResponse(
            {"status": "success", "data": {"resultType": "matrix", "result": result}}
        )

    metrics = FastAPI()
    metrics.get("/metrics")(lambda: PlainTextResponse(GatewayMetrics().render().decode()))
    with serve_fake(app) as prom, serve_fake(metrics) as url:
        code, out = run("--url", url, "--model", MODEL, "--prometheus", prom, "--since", "1h",
                        "--arm", "a", "--arm", "b", capsys=capsys)  # fmt: skip
    assert code == 0, out
    assert "over the last 3600 s" in out and "b raises p50 e2e by" in out
    # both busy all the time, but upstream arms on separate servers: not confounded
    assert "a and b run on separate devices" in out
    assert any(q["query"] == "carousel_arm_info" for q in queries)


def test_since_without_a_source_for_it_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run("--url", "http://127.0.0.1:9", "--since", "1h", capsys=capsys)
    assert code == 2 and "--since needs --prometheus or --record" in out


def test_static_is_the_default_baseline() -> None:
    assert baseline_first(["orca", "lpm", "static"]) == ["static", "orca", "lpm"]
    assert baseline_first(["orca", "lpm"]) == ["orca", "lpm"]
