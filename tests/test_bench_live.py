"""`carousel bench` end to end against a tiny fake OpenAI-compatible streaming server.

The fake server runs in a background uvicorn thread on a free loopback port. Per arm it keeps
a toy engine (the `static` arm batches request-level, any other arm refills seats every step
like Orca) that emits one token per running sequence per step and records each step as a
/debug/trace iteration, so the carousel picture has real staircases and refills to draw.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main
from bench.fake_server import FakeOptions, fake_server

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench_args(url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--url", f"{url}/v1", "--model", "toy", "--num-requests", "8",
        "--input-len", "fixed:16", "--output-len", "uniform:2:12",
        "--out", str(out), "--no-progress", "--warmups", "0", *extra,
    ]  # fmt: skip


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, path


def test_two_arm_bench_writes_sane_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server() as (url, seen):
        rc = main(bench_args(url, out, "--arm", "static", "--arm", "orca",
                             "--slo-ttft", "10000", "--slo-tpot", "10000"))  # fmt: skip
    assert rc == 0
    assert [s["arm"] for s in seen] == ["static"] * 8 + ["orca"] * 8
    body = seen[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    per_arm = [
        {s["body"]["messages"][0]["content"]: s["body"]["max_tokens"] for s in part}
        for part in (seen[:8], seen[8:])
    ]
    assert per_arm[0] == per_arm[1] and len(per_arm[0]) == 8  # the same workload for both arms

    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == 1 and report["interrupted"] is False
    assert report["config"]["arms"] == ["static", "orca"]
    assert [r["arm"] for r in report["runs"]] == ["static", "orca"]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["cancelled"]) == (8, 0, 0)
        assert m["total_output_tokens"] == sum(s["body"]["max_tokens"] for s in seen[:8])
        assert m["total_input_tokens"] == 8 * 16
        assert m["request_throughput"] > 0 and m["output_throughput"] > 0
        assert m["goodput"] == pytest.approx(m["request_throughput"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            stats = m[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
        assert m["ttft_ms"]["p99"] <= m["e2e_latency_ms"]["p99"]
        assert run["mean_prompt_tokens"] == 16
        trace = run["trace"]
        assert trace["available"] is True and trace["max_num_seqs"] == 4
        assert 0 < trace["seat_occupancy"] <= 1 and 0 < trace["mean_batch_size"] <= 4
        # one token per sequence per toy step: the run's steps cover the longest request
        assert trace["num_iterations"] >= max(s["body"]["max_tokens"] for s in seen[:8])
    assert report["comparison"][0]["baseline"] == "static"
    assert report["comparison"][0]["arm"] == "orca"

    assert sorted(report["files"]["plots"]) == ["carousel.png", "latency_cdf.png"]
    for name in report["files"]["plots"]:
        assert_png(out / name)
    md = (out / "report.md").read_text()
    assert "## Throughput" in md and "![" in md and "carousel.png" in md
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 16 and json.loads(lines[0])["success"] is True


def test_missing_trace_and_failed_requests_are_reported(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(trace=False, fail_every=4, usage=False)) as (url, _):
        rc = main(bench_args(url, out, "--arm", "orca", "--endpoint", "completions",
                             "--rate", "200", "--no-ignore-eos"))  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    m = report["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (6, 2)
    assert report["runs"][0]["errors"] == {"HTTP 500: boom": 2}
    assert m["goodput"] is None and m["total_input_tokens"] == 0
    assert m["total_output_tokens"] > 0  # counted from content chunks: no usage chunk
    assert report["runs"][0]["trace"]["available"] is False
    assert report["files"]["plots"] == ["latency_cdf.png"]
    assert not (out / "carousel.png").exists()
    assert any("/debug/trace" in note for note in report["notes"])
    md = (out / "report.md").read_text()
    assert "No carousel picture" in md and "HTTP 500: boom" in md


def test_sweep_draws_throughput_against_rate(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server() as (url, seen):
        rc = main(bench_args(url, out, "--arm", "orca", "--sweep-rates", "100,400",
                             "--num-requests", "4", "--warmups", "1"))  # fmt: skip
    assert rc == 0 and len(seen) == 2 * (1 + 4)  # one unmeasured warm-up request per run
    report = json.loads((out / "report.json").read_text())
    assert [r["rate"] for r in report["runs"]] == [100.0, 400.0]
    assert [r["metrics"]["completed"] for r in report["runs"]] == [4, 4]
    assert sorted(report["files"]["plots"]) == [
        "carousel_rate100.png", "carousel_rate400.png",
        "latency_cdf_rate100.png", "latency_cdf_rate400.png", "sweep.png",
    ]  # fmt: skip
    assert_png(out / "sweep.png")


def test_no_server_is_named_by_the_probe_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    rc = main(bench_args(f"http://127.0.0.1:{port}", tmp_path, "--num-requests", "2"))
    assert rc == 1
    err = capsys.readouterr().err
    assert "probe request failed" in err and "Connection refused" in err
    assert f"127.0.0.1:{port}" in err and "is the server running" in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_stops_cleanly_and_still_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(step_s=0.05)) as (url, seen):
        args = bench_args(url, out, "--arm", "a", "--arm", "b", "--output-len", "fixed:200")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while len(seen) < 8:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr.decode()
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True
    assert [r["arm"] for r in report["runs"]] == ["a"]  # arm b never started
    m = report["runs"][0]["metrics"]
    assert m["cancelled"] == 8 and m["completed"] == 0
    assert (out / "report.md").exists()


def test_verdict_compares_the_arms_schedules(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # toy steps far longer than the burst's spread: most arrivals land in the same step
    with fake_server(FakeOptions(step_s=0.05)) as (url, _):
        rc = main(bench_args(url, out, "--arm", "orca", "--arm", "orca-again", "--arm", "static"))
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for entry in report["comparison"]:
        by_arm.setdefault(entry["arm"], []).append(entry)
    assert {e["same_schedule"] for e in by_arm["static"]} == {False}
    again = {e["schedule_similarity"] for e in by_arm["orca-again"]}
    assert len(again) == 1 and 0 < again.pop() <= 1
