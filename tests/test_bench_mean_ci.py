"""scripts/bench_mean_ci.py on a requests.jsonl whose answer is known: the verdict's bootstrap
(bench/stats.py) over requests, and over runs then requests when the bench repeated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_requests(path: Path, levels: list[float], n: int = 400) -> None:
    """Per repeat, orca's TTFTs, and sjf's the same requests' times that repeat's level (the
    policy, or the machine's load during sjf's run), paired by index."""
    rng = np.random.default_rng(3)
    rows = []
    for repeat, level in enumerate(levels):
        ttft = rng.lognormal(np.log(0.5), 0.6, n)
        for i, value in enumerate(ttft):
            for arm, scale in (("orca", 1.0), ("sjf", level * rng.lognormal(0, 0.05))):
                user = "light" if i % 4 else "heavy"
                row = {"arm": arm, "repeat": repeat, "index": i, "success": i % 50 != 7,
                       "ttft_s": float(value * scale), "user": user}  # fmt: skip
                rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def mean_ci(path: Path, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts/bench_mean_ci.py"), str(path), "orca", "sjf"]
    done = subprocess.run([*command, *extra], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def interval(line: str) -> tuple[float, float]:
    ci = line.split("95% CI ")[1].split(";")[0]
    low, high = ci.split(" to ")
    return float(low.rstrip("%")) / 100, float(high.rstrip("%")) / 100


def test_a_halved_mean_is_found_and_covered(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    write_requests(path, [0.5])
    line = mean_ci(path)
    low, high = interval(line)
    assert low < -0.5 < high < 0  # the truth, -50%, inside; no difference, 0, outside
    assert "in 1 run(s); one run per arm: run-to-run variation unmeasured" in line
    assert "n = 392 paired requests" in line  # failed requests left out of both arms


def test_repeats_see_a_run_level_drift_and_a_user_filter_keeps_its_requests(
    tmp_path: Path,
) -> None:
    path = tmp_path / "requests.jsonl"
    write_requests(path, [0.8, 1.0, 1.25])  # no policy effect: the load moved between runs
    line = mean_ci(path, "--user", "heavy")
    low, high = interval(line)
    assert low < 0 < high and high - low > 0.3  # 3 runs of +-20%: a wide interval, not a call
    assert "n = 300 paired requests in 3 run(s))" in line
