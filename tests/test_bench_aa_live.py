"""A/A on a live Carousel: one policy against itself must not read as a difference.

Two local sim arms (both `orca`, real sleeps at a quarter of the modelled time) behind one
gateway, the same workload for each, three repeats in alternating order so the verdict
resamples runs as well as requests. The control, `orca` against `static` on the same load,
must read as a difference, so the A/A pass is not a verdict that cannot find anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main
from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import serve_app

MODEL = "aa-model"
#: the latency metrics the verdict judges per request
LATENCY = {"ttft_p50", "tpot_p50", "e2e_p50"}


def verdict(tmp_path: Path, candidate: str) -> dict[str, dict[str, Any]]:
    arms = [
        {"name": "orca", "scheduler": "orca", "weight": 50},
        {"name": "candidate", "scheduler": candidate, "weight": 50},
    ]
    settings = Settings(backend="sim", served_model_name=MODEL, arms=arms, sim_time_scale=0.25)  # type: ignore[arg-type]
    out = tmp_path / candidate
    with serve_app(create_app(settings)) as url:
        rc = main([
            "--url", f"{url}/v1", "--model", MODEL, "--arm", "orca", "--arm", "candidate",
            "--num-requests", "60", "--rate", "8", "--input-len", "uniform:16:256",
            "--output-len", "uniform:8:64", "--repeats", "3", "--warmups", "2",
            "--equivalence-margin", "0.1", "--out", str(out), "--no-progress", "--no-trace",
        ])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    return {e["metric"]: e for e in report["comparison"] if e["arm"] == "candidate"}


@pytest.mark.slow
def test_orca_against_itself_reads_no_difference(tmp_path: Path) -> None:
    rows = verdict(tmp_path, "orca")
    assert set(rows) >= LATENCY
    for metric, row in rows.items():
        assert row["outcome"] != "difference", (metric, row["sentence"])


@pytest.mark.slow
def test_orca_against_static_reads_a_difference(tmp_path: Path) -> None:
    rows = verdict(tmp_path, "static")
    assert any(rows[m]["outcome"] == "difference" for m in LATENCY), {
        m: rows[m]["sentence"] for m in LATENCY
    }
