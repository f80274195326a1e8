"""scripts/rollout_sim.py: the rollout's error rates and exposures on synthetic traffic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rollout_sim", ROOT / "scripts/rollout_sim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rollout_sim"] = module
    spec.loader.exec_module(module)
    return module


def outcomes(sim: ModuleType, scenario: str, rollouts: int, step_requests: int) -> list:
    rng = np.random.default_rng(7)
    spec = sim.build_spec(sim.DEFAULT_SETTINGS)
    draw = sim.SCENARIOS[scenario]
    return [sim.simulate(rng, spec, draw, step_requests) for _ in range(rollouts)]


def test_aa_rollouts_advance_and_roll_back_falsely_at_most_alpha(sim: ModuleType) -> None:
    runs = outcomes(sim, "aa", 400, 12_000)
    alpha = sim.DEFAULT_SETTINGS.alpha
    slack = 3 * np.sqrt(alpha * (1 - alpha) / len(runs))
    assert np.mean([o.advanced for o in runs]) <= alpha + slack
    assert np.mean([o.final == "rolled_back" for o in runs]) <= alpha + slack


def test_a_20_percent_faster_candidate_reaches_100_percent(sim: ModuleType) -> None:
    runs = outcomes(sim, "faster", 100, 36_000)
    assert np.mean([o.final == "promoted" for o in runs]) >= 0.95
    assert all(len(o.requests_per_step) == 3 for o in runs if o.final == "promoted")


@pytest.mark.parametrize("scenario", ["errors", "slow_ttft"])
def test_a_worse_candidate_is_rolled_back_early(sim: ModuleType, scenario: str) -> None:
    runs = outcomes(sim, scenario, 100, 36_000)
    assert np.mean([o.final == "rolled_back" for o in runs]) >= 0.95
    assert np.median([o.exposure for o in runs if o.final == "rolled_back"]) < 1000


def test_the_bootstrap_verdict_at_every_look_inflates_false_alarms(sim: ModuleType) -> None:
    rng = np.random.default_rng(11)
    spec = sim.build_spec(sim.DEFAULT_SETTINGS)
    results = np.asarray([sim.bootstrap_aa(rng, spec, 2000, 20, 200) for _ in range(40)])
    boot_false = np.mean(results[:, 0] | results[:, 1])
    sequential_false = np.mean(results[:, 2] | results[:, 3])
    assert boot_false >= 0.15
    assert sequential_false <= 0.05


def test_the_script_prints_the_table(sim: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--rollouts", "5", "--bootstrap-rollouts", "2", "--bootstrap-requests", "600"]
    assert sim.main([*args, "--bootstrap-looks", "3", "--resamples", "50"]) == 0
    out = capsys.readouterr().out
    assert "| aa | 5 |" in out and "bootstrap verdict" in out
