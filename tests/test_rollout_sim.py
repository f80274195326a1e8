"""scripts/rollout_sim.py: the rollout's error rates, power and exposure with load and users.

Smaller versions of the table in docs/rollout.md: short engine streams (simulated once per
module, kept in a temporary cache), fewer rollouts, the same decision core."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from gateway.rollout.evidence import StepObserver, Tally

ROOT = Path(__file__).resolve().parent.parent
STREAM_REQUESTS = 3000
STEP_REQUESTS = 12_000


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rollout_sim", ROOT / "scripts/rollout_sim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rollout_sim"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engines(sim: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> object:
    return sim.Engines(8.0, STREAM_REQUESTS, tmp_path_factory.mktemp("streams"))


def outcomes(
    sim: ModuleType,
    engines: object,
    design: object,
    rollouts: int,
    seed: int = 7,
    step_requests: int = STEP_REQUESTS,
) -> list:
    rng = np.random.default_rng(seed)
    spec = sim.build_spec(sim.DEFAULT_SETTINGS)
    return [
        sim.simulate_rollout(rng, spec, design, engines, step_requests, 0.3)
        for _ in range(rollouts)
    ]


def slack(p: float, n: int) -> float:
    return 3 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("users", [20, 1000])
def test_aa_in_the_control_topology_stays_under_alpha_by_user(
    sim: ModuleType, engines: object, users: int
) -> None:
    runs = outcomes(sim, engines, sim.Design("aa", users=users), 150)
    alpha = sim.DEFAULT_SETTINGS.alpha
    assert np.mean([o.advanced for o in runs]) <= alpha + slack(alpha, len(runs))
    assert np.mean([o.final == "rolled_back" for o in runs]) <= alpha + slack(alpha, len(runs))


def step_rates(
    sim: ModuleType, engines: object, design: object, share: float, steps: int, per_unit: int
) -> tuple[float, float, float]:
    """(false advance, false rollback, either) of `steps` A/A steps at `share`, each run to
    its end."""
    rng = np.random.default_rng(11)
    settings = sim.DEFAULT_SETTINGS.model_copy(update={"requests_per_unit": per_unit})
    spec = sim.build_spec(settings)
    results = np.asarray(
        [sim.step_aa(rng, spec, design, share, engines, STEP_REQUESTS, 0.3) for _ in range(steps)]
    )
    advance, rollback = results.mean(axis=0)
    return float(advance), float(rollback), float(results.any(axis=1).mean())


@pytest.mark.parametrize("share", [25, 50])
def test_aa_steps_under_load_stay_under_alpha_with_requests_dealt_into_units(
    sim: ModuleType, engines: object, share: float
) -> None:
    design = sim.Design("aa", assignment="request", users=10_000)
    advance, rollback, _ = step_rates(sim, engines, design, share, 120, per_unit=5)
    alpha = sim.DEFAULT_SETTINGS.alpha
    assert advance <= alpha + slack(alpha, 120)
    assert rollback <= alpha + slack(alpha, 120)


def test_one_request_a_sample_rejects_a_true_null_under_load(
    sim: ModuleType, engines: object
) -> None:
    """Known answer: identical engines at a 50% step, (nearly) each request its own sample
    (blocks of 3 requests, one an arm). An engine's queue and batch carry over from one request
    to the next, so near pairs are predictable and the tests reject a true null far more often
    than alpha; this is why requests without a user form longer blocks of several requests an
    arm (gateway/rollout/evidence.py)."""
    design = sim.Design("aa", assignment="request", users=10_000)
    _, _, either = step_rates(sim, engines, design, 50, 150, per_unit=1)
    assert either >= 0.12


def test_aa_against_the_baselines_own_engine_advances_falsely(
    sim: ModuleType, engines: object
) -> None:
    """What the gateway now refuses: at 5% the candidate's engine idles beside a baseline
    engine carrying 95%, so an identical candidate looks faster."""
    runs = outcomes(sim, engines, sim.Design("aa", topology="baseline", users=1000), 30)
    assert np.mean([o.advanced for o in runs]) >= 0.5


def test_a_faster_candidate_advances_with_per_request_assignment(
    sim: ModuleType, engines: object
) -> None:
    """Power within this test's short streams (a 50% step here holds 2,000 requests at most;
    docs/rollout.md's full run, with longer ones, promotes in every rollout); the 5% step
    holds up to the full run's 36,000 requests (the median decision took 6,628)."""
    design = sim.Design("faster", assignment="request")
    runs = outcomes(sim, engines, design, 40, step_requests=36_000)
    assert np.mean([o.advanced for o in runs]) >= 0.9
    assert not any(o.final == "rolled_back" for o in runs)


@pytest.mark.parametrize("scenario", ["slower", "refusing", "dead"])
def test_a_worse_candidate_is_rolled_back_with_per_request_assignment(
    sim: ModuleType, engines: object, scenario: str
) -> None:
    runs = outcomes(sim, engines, sim.Design(scenario, assignment="request"), 40)
    assert np.mean([o.final == "rolled_back" for o in runs]) >= 0.9
    assert np.median([o.exposure for o in runs if o.final == "rolled_back"]) < 1000


@pytest.mark.parametrize("users", [20, 100])
def test_a_dead_candidate_is_rolled_back_however_few_users(
    sim: ModuleType, engines: object, users: int
) -> None:
    runs = outcomes(sim, engines, sim.Design("dead", users=users), 40)
    exposed = [o for o in runs if o.exposure > 0]  # at 5%, few users may leave it no traffic
    assert np.mean([o.final == "rolled_back" for o in exposed]) >= 0.9


def test_the_simulators_units_match_the_gateways(sim: ModuleType, engines: object) -> None:
    """One step's traffic scored by the simulator's vectorised units and by the gateway's
    StepObserver, request by request: the same units and the same target statistics."""
    rng = np.random.default_rng(3)
    spec = sim.build_spec(sim.DEFAULT_SETTINGS)
    population = sim.Population.draw(rng, 50, 0.3)
    traffic = sim.draw_step(rng, sim.Design("faster", users=50), population, 0.25, 3000, engines)
    per_unit = spec.settings.requests_per_unit
    ref_at, ref = sim.unit_samples(traffic, ~traffic.candidate, per_unit, {})
    cand_at, cand = sim.unit_samples(traffic, traffic.candidate, per_unit, {})
    observer, tally = StepObserver(spec), Tally()
    for i in range(traffic.candidate.size):
        role = "candidate" if traffic.candidate[i] else "reference"
        sample = {k: float(v[i]) for k, v in traffic.values.items()}
        tally.merge(observer.observe(role, sample, str(traffic.unit[i])))
    assert tally.units == {"reference": ref_at.size, "candidate": cand_at.size}
    k = min(ref["ttft_ms"].size, cand["ttft_ms"].size)
    assert tally.n["target"] == k


def test_the_script_prints_the_table(sim: ModuleType, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:  # fmt: skip
    args = ["--rollouts", "3", "--users", "100", "--scenarios", "aa", "dead"]
    args += ["--stream-requests", "1000", "--step-requests", "4000", "--cache", str(tmp_path)]
    args += ["--bootstrap-rollouts", "2", "--bootstrap-requests", "600", "--step-rollouts", "2"]
    assert sim.main([*args, "--bootstrap-looks", "3", "--resamples", "50"]) == 0
    out = capsys.readouterr().out
    assert "| aa | control | user / user | 100 | 3 |" in out and "bootstrap verdict" in out
    assert "| 50% | request / request | 100 |" in out
