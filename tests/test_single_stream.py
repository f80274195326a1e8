"""scripts/single_stream.py: streamed answers from each endpoint in turn, one row per endpoint,
ratios against the first; the servers it starts are gone when it returns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_each_endpoint_gets_its_answers_timed_and_a_ratio_against_the_first(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rows.json"
    # one slow simulated server (30 ms per decode step at scale 15) and one instant one
    cmd = [
        sys.executable, "scripts/single_stream.py", "--rounds", "2", "--max-tokens", "6",
        "--carousel", "slow=--backend sim --sim-time-scale 15",
        "--carousel", "fast=--backend sim", "--log-dir", str(tmp_path), "--json-out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    rows = {row["endpoint"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["slow", "fast"]
    for row in rows.values():
        assert row["answers"] == 2
        assert row["tokens_per_answer"] == 6
    assert rows["slow"]["itl_speedup_vs_first"] == 1.0
    assert rows["fast"]["median_itl_ms"] < rows["slow"]["median_itl_ms"]
    assert rows["fast"]["itl_speedup_vs_first"] > 1.0
    for line in done.stdout.splitlines():  # the started servers were stopped
        if line.startswith("$ "):
            port = line.split("--port ")[1].split()[0]
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
