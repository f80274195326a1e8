"""The live rollout: weights by step, users stay put, decisions logged, state resumed."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gateway.app import create_app
from gateway.arms.choice import choose_by_weight, user_point
from gateway.arms.deployment import Deployment
from gateway.cli import main as cli_main
from gateway.rollout.controller import RolloutController, RolloutMetrics
from gateway.rollout.decision import decide
from gateway.rollout.store import (
    FileRolloutStore,
    MemoryRolloutStore,
    RedisRolloutStore,
    RolloutStore,
)
from gateway.settings.load import Settings
from gateway.settings.rollout import RolloutSettings
from tests.conftest import serve_app, sim_arm

#: one request a unit: the controller's mechanics, request by request
ROLLOUT = RolloutSettings(
    baseline="orca",
    candidate="sjf",
    guardrails={"error_rate": 0.005, "ttft_p99": 0.10, "tpot_p50": 0.10},
    min_requests=50,
    requests_per_unit=1,
)


@dataclass
class FakeArm:
    name: str
    weight: float = 1.0


def controller(
    store: RolloutStore | None = None,
    registry: CollectorRegistry | None = None,
    sync_every: int = 1,
    lease_s: float = 10.0,
) -> tuple[RolloutController, list[FakeArm]]:
    arms = [FakeArm("orca"), FakeArm("other"), FakeArm("sjf")]
    metrics = RolloutMetrics(registry) if registry is not None else None
    rollout = RolloutController(
        "m", ROLLOUT, arms, store or MemoryRolloutStore(), metrics,  # type: ignore[arg-type]
        sync_every=sync_every, lease_s=lease_s,
    )  # fmt: skip
    return rollout, arms


def feed(rollout: RolloutController, ttft_scale: float, requests: int, seed: int = 0) -> None:
    """Requests split at the current step's share, stopping once the rollout has ended."""
    rng = np.random.default_rng(seed)
    for _ in range(requests):
        if rollout.state.status not in ("running", "held"):
            return
        arm = "sjf" if rng.random() * 100 < rollout.share else "orca"
        scale = ttft_scale if arm == "sjf" else 1.0
        ttft = float(rng.lognormal(np.log(200), 0.5)) * scale
        rollout.observe(arm, {"ttft_ms": ttft, "tpot_ms": 20.0, "e2e_ms": ttft + 500, "error": 0.0})


def weights(arms: list[FakeArm]) -> dict[str, float]:
    return {a.name: a.weight for a in arms}


def test_only_the_two_arms_carry_weight_at_the_first_step() -> None:
    _, arms = controller()
    assert weights(arms) == {"orca": 95, "other": 0, "sjf": 5}


def test_a_user_moves_to_the_candidate_at_most_once_and_back_only_on_rollback() -> None:
    rollout, arms = controller()
    users = [user_point(f"user-{i}") for i in range(2000)]
    history: list[list[str]] = [[] for _ in users]
    for step in range(len(ROLLOUT.steps)):
        rollout.state.step = step
        rollout.apply_weights()
        for i, point in enumerate(users):
            history[i].append(choose_by_weight(arms, point).name)  # type: ignore[union-attr]
    for arms_seen in history:
        assert "other" not in arms_seen
        first = arms_seen.index("sjf")  # every user is on the candidate at 100%
        assert set(arms_seen[:first]) <= {"orca"} and set(arms_seen[first:]) == {"sjf"}
    rollout.command("abort")
    assert {choose_by_weight(arms, p).name for p in users} == {"orca"}  # type: ignore[union-attr]


def test_a_slower_candidate_is_rolled_back_with_its_evidence() -> None:
    registry = CollectorRegistry()
    rollout, arms = controller(registry=registry)
    feed(rollout, ttft_scale=1.5, requests=40_000)
    assert rollout.state.status == "rolled_back"
    assert weights(arms)["sjf"] == 0 and weights(arms)["orca"] == 100
    decision = rollout.state.decisions[-1]
    assert decision["kind"] == "rollback"
    assert decision["reason"].startswith(("guardrail_", "regression_"))
    guardrails = len(rollout.spec.of_role("guardrail"))  # the declared ones and the regression
    assert decision["e_values"][decision["reason"]] >= guardrails / ROLLOUT.alpha
    assert decision["n"]["candidate"] > 0
    count = registry.get_sample_value(
        "carousel_rollout_decisions_total", {"model": "m", "kind": "rollback"}
    )
    assert count == 1
    assert (
        registry.get_sample_value("carousel_rollout_arm_weight", {"model": "m", "arm": "sjf"}) == 0
    )


def test_a_faster_candidate_advances_step_by_step_to_100_percent() -> None:
    rollout, arms = controller()
    feed(rollout, ttft_scale=0.7, requests=60_000)
    assert rollout.state.status == "promoted"
    assert [d["kind"] for d in rollout.state.decisions] == ["advance"] * 3
    assert [d["share"] for d in rollout.state.decisions] == [5, 25, 50]
    assert weights(arms) == {"orca": 0, "other": 0, "sjf": 100}


def test_a_restarted_gateway_resumes_the_rollout_where_it_stood(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    rollout, _ = controller(FileRolloutStore(path))
    feed(rollout, ttft_scale=0.7, requests=60_000)
    rollout.state.step, rollout.state.status = 1, "running"  # as if stopped mid-rollout
    rollout.save()
    again, arms = controller(FileRolloutStore(path))
    assert again.state.step == 1 and len(again.state.decisions) == 3
    assert weights(arms) == {"orca": 75, "other": 0, "sjf": 25}


def test_operators_pause_resume_and_promote_and_are_refused_what_does_not_apply() -> None:
    rollout, arms = controller()
    rollout.command("pause")
    feed(rollout, ttft_scale=1.5, requests=5000)
    assert rollout.state.status == "paused" and rollout.status()["n"]["candidate"] == 0
    rollout.command("resume")
    rollout.command("promote")
    assert weights(arms)["sjf"] == 100
    with pytest.raises(ValueError, match="cannot abort a rollout that is promoted"):
        rollout.command("abort")
    with pytest.raises(ValueError, match="unknown action"):
        rollout.command("restart")


def test_replicas_share_one_rollout_and_a_survivor_finishes_it(redis_url: str) -> None:
    """Two replicas feed one Redis store: one decides at a time, both route by the same step,
    and when the decider dies the other takes over with no step skipped or repeated."""
    prefix = f"test-rollout-{uuid.uuid4().hex}"
    first, first_arms = controller(RedisRolloutStore(redis_url, prefix), sync_every=5, lease_s=0.3)
    second, second_arms = controller(
        RedisRolloutStore(redis_url, prefix), sync_every=5, lease_s=0.3
    )
    rng = np.random.default_rng(0)

    def serve(replica: RolloutController) -> None:
        arm = "sjf" if rng.random() * 100 < replica.share else "orca"
        ttft = float(rng.lognormal(np.log(200), 0.5)) * (0.7 if arm == "sjf" else 1.0)
        replica.observe(arm, {"ttft_ms": ttft, "tpot_ms": 20.0, "e2e_ms": ttft, "error": 0.0})

    while first.state.step == 0:
        serve(first)
        serve(second)
    for _ in range(5):  # the other replica's next sync adopts the new step
        serve(second)
    assert second.state.step == first.state.step == 1
    assert weights(first_arms) == weights(second_arms) == {"orca": 75, "other": 0, "sjf": 25}
    time.sleep(0.5)  # `first` dies: its lease expires
    for _ in range(200_000):
        if second.state.status == "promoted":
            break
        serve(second)
    assert second.state.status == "promoted"
    decisions = second.state.decisions
    assert [d["kind"] for d in decisions] == ["advance"] * 3
    assert [d["share"] for d in decisions] == [5, 25, 50]
    assert [d["replica"] for d in decisions[1:]] == [second.owner] * 2  # after `first` died
    assert second.status()["decider"] == second.status()["replica"] == second.owner
    restarted, arms = controller(RedisRolloutStore(redis_url, prefix))
    assert restarted.state.status == "promoted" and weights(arms)["sjf"] == 100


ARMS = [
    {"name": "orca", "scheduler": "orca"},
    {"name": "sjf", "scheduler": "sjf"},
]


def test_two_local_arms_on_one_device_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValidationError, match="sharing one device.*upstream arm"):
        Settings(backend="sim", arms=ARMS, rollout=ROLLOUT.model_dump())  # type: ignore[arg-type]


def test_a_rollout_arm_that_is_not_an_arm_is_refused() -> None:
    rollout = ROLLOUT.model_copy(update={"candidate": "edf"}).model_dump()
    with pytest.raises(ValidationError, match=r"\['edf'\] are not arms"):
        Settings(backend="sim", arms=ARMS, rollout=rollout)  # type: ignore[arg-type]


def upstream_arms() -> list[dict[str, object]]:
    upstream = {"base_urls": ["http://127.0.0.1:9/v1"], "model": "x"}
    return [{"name": n, "upstream": upstream} for n in ("orca", "sjf")]


#: the two-engine topology: the tests compare equal loads only at 50%
HALVES = ROLLOUT.model_copy(update={"steps": [50, 100]})


def test_an_admin_principal_from_the_key_file_steers_the_rollout_and_no_one_else(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "keys.yaml"
    key_file.write_text(
        "- {name: team-a, keys: [user-key]}\n- {name: ops, keys: [ops-key], admin: true}\n"
    )
    settings = Settings(
        backend="sim",
        served_model_name="m",
        arms=upstream_arms(),  # type: ignore[arg-type]
        rollout=HALVES.model_dump(),  # type: ignore[arg-type]
        api_key_file=str(key_file),
    )
    deployment = Deployment("m", [sim_arm(scheduler="orca"), sim_arm(scheduler="sjf")])
    with serve_app(create_app(settings, [deployment])) as url:
        user = {"Authorization": "Bearer user-key"}
        refused = httpx.post(f"{url}/admin/rollout/pause", headers=user)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_admin"
        ops = {"Authorization": "Bearer ops-key"}
        assert httpx.post(f"{url}/admin/rollout/pause", headers=ops).json()["status"] == "paused"


def test_admin_routes_show_and_steer_the_rollout_behind_an_admin_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(
        backend="sim",
        served_model_name="m",
        arms=upstream_arms(),  # type: ignore[arg-type]
        rollout=HALVES.model_dump(),  # type: ignore[arg-type]
        api_keys=["user-key", "admin-key"],
        admin_api_keys=["admin-key"],
    )
    deployment = Deployment("m", [sim_arm(scheduler="orca"), sim_arm(scheduler="sjf")])
    admin = {"Authorization": "Bearer admin-key"}
    with ExitStack() as stack:
        url = stack.enter_context(serve_app(create_app(settings, [deployment])))
        refused = httpx.get(f"{url}/admin/rollout", headers={"Authorization": "Bearer user-key"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_admin"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for arm in ("orca", "sjf"):
            headers = {"Authorization": "Bearer user-key", "X-Carousel-Arm": arm}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200
        status = httpx.get(f"{url}/admin/rollout", headers=admin).json()
        assert status["status"] == "running" and status["candidate_share"] == 50
        # pinned requests are served and counted apart, never evidence
        assert status["n"] == {"reference": 0, "candidate": 0}
        assert status["not_randomised"] == {"orca": 1, "sjf": 1}
        assert cli_main(["rollout", "pause", "--url", url, "--api-key", "admin-key"]) == 0
        out = capsys.readouterr().out  # the server's log lines too: the CLI's JSON is last
        assert json.loads(out[out.rindex('{\n  "model"') :])["status"] == "paused"
        assert cli_main(["rollout", "status", "--url", url, "--api-key", "user-key"]) == 1
        aborted = httpx.post(f"{url}/admin/rollout/abort", headers=admin)
        assert aborted.json()["status"] == "aborted"
        again = httpx.post(f"{url}/admin/rollout/abort", headers=admin)
        assert again.status_code == 400 and again.json()["error"]["param"] == "action"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'carousel_rollout_arm_weight{arm="sjf",model="m"} 0.0' in metrics


def test_a_rollout_comparing_unequal_loads_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"unequal loads.*5% \(19x\).*control:.*\[50, 100\]"):
        Settings(backend="sim", arms=upstream_arms(), rollout=ROLLOUT.model_dump())  # type: ignore[arg-type]
    Settings(backend="sim", arms=upstream_arms(), rollout=HALVES.model_dump())  # type: ignore[arg-type]


def test_a_control_arm_carries_the_candidates_share() -> None:
    upstream = {"base_urls": ["http://127.0.0.1:9/v1"], "model": "x"}
    two = {"base_urls": ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"], "model": "x"}
    arms = [
        {"name": "orca", "upstream": upstream},
        {"name": "orca-control", "upstream": upstream},
        {"name": "sjf", "upstream": upstream},
    ]
    rollout = ROLLOUT.model_copy(update={"control": "orca-control"}).model_dump()
    settings = Settings(backend="sim", arms=arms, rollout=rollout)  # type: ignore[arg-type]
    topology = settings.rollout_topology()
    assert topology.weights(5) == {"orca": 90, "orca-control": 5, "sjf": 5}
    assert topology.weights(50) == {"orca": 0, "orca-control": 50, "sjf": 50}
    assert topology.weights(100) == {"orca": 0, "orca-control": 0, "sjf": 100}
    over = ROLLOUT.model_copy(update={"control": "orca-control", "steps": [5, 70, 100]})
    with pytest.raises(ValidationError, match=r"step\(s\) 70%.*at most 50%"):
        Settings(backend="sim", arms=arms, rollout=over.model_dump())  # type: ignore[arg-type]
    arms[2] = {"name": "sjf", "upstream": two}
    with pytest.raises(ValidationError, match=r"2 engine\(s\).*`orca-control` 1"):
        Settings(backend="sim", arms=arms, rollout=rollout)  # type: ignore[arg-type]


def test_resume_carries_the_held_steps_guardrail_evidence() -> None:
    rollout, _ = controller()
    for i in range(60):  # a candidate failing every other request: evidence, short of rollback
        rollout.observe("orca", {"ttft_ms": 100.0, "e2e_ms": 200.0, "error": 0.0})
        ok = {"ttft_ms": 100.0, "e2e_ms": 200.0, "error": 0.0}
        rollout.observe("sjf", {"error": 1.0} if i % 2 else ok)
        if rollout.store.tally(0).log_e("guardrail_error_rate") > 1.0:
            break
    rollout.command("pause")
    held = rollout.store.tally(0).log_e("guardrail_error_rate")
    assert 0 < held < rollout.spec.log_threshold("guardrail")
    rollout.command("resume")
    assert rollout.state.epoch == 1
    assert rollout.state.carried["guardrail_error_rate"] == pytest.approx(held)
    assert rollout.status()["carried"]["guardrail_error_rate"] == pytest.approx(np.exp(held), 1e-3)


def test_an_abort_is_never_overwritten_by_another_replicas_decision(redis_url: str) -> None:
    """Two writers on real Redis: the decider read the state before an operator's abort on
    another replica and then decides to advance: its save is refused, and it adopts the abort."""
    prefix = f"test-rollout-cas-{uuid.uuid4().hex}"
    decider, arms = controller(RedisRolloutStore(redis_url, prefix), sync_every=10**9)
    operator, _ = controller(RedisRolloutStore(redis_url, prefix), sync_every=10**9)
    rng = np.random.default_rng(3)
    for _ in range(4000):  # a faster candidate, synced only when asked
        arm = "sjf" if rng.random() < 0.5 else "orca"
        ttft = float(rng.lognormal(np.log(200), 0.5)) * (0.5 if arm == "sjf" else 1.0)
        decider.observe(arm, {"ttft_ms": ttft, "tpot_ms": 20.0, "e2e_ms": ttft, "error": 0.0})
    decider._flush()
    tally = decider.state.tally = decider.store.tally(0)
    log_e = {t.name: tally.log_e(t.name) for t in decider.spec.tests}
    would = decide(
        decider.spec, tally.requests["reference"], tally.requests["candidate"], log_e, 1.0
    )
    assert would is not None and would.kind == "advance"
    operator.command("abort")  # meanwhile, on the other replica
    assert decider.look() is None  # the advance lost the race
    assert decider.state.status == "aborted" and weights(arms)["sjf"] == 0
    stored = RedisRolloutStore(redis_url, prefix).load()
    assert stored is not None and stored["status"] == "aborted"
    assert [d["kind"] for d in stored["decisions"]] == ["abort"]


def test_a_write_with_a_stale_version_is_refused_by_every_store(
    tmp_path: Path, redis_url: str
) -> None:
    prefix = f"test-rollout-cas-{uuid.uuid4().hex}"
    stores: list[RolloutStore] = [
        MemoryRolloutStore(),
        FileRolloutStore(tmp_path / "state.json"),
        RedisRolloutStore(redis_url, prefix),
    ]
    for store in stores:
        assert store.save({"status": "running"}, 0)
        assert not store.save({"status": "promoted"}, 0)  # someone wrote version 1 meanwhile
        assert store.save({"status": "aborted"}, 1)
        assert store.load() == {"status": "aborted", "version": 2}


def test_a_candidate_that_stops_answering_is_rolled_back_without_waiting_for_a_test() -> None:
    rollout, arms = controller(sync_every=10**9)  # no test ever looked at
    for _ in range(9):
        rollout.observe("orca", {"ttft_ms": 100.0, "e2e_ms": 200.0, "error": 0.0})
        assert rollout.observe("sjf", {"error": 1.0}) is None
    rollout.observe("orca", {"ttft_ms": 100.0, "e2e_ms": 200.0, "error": 0.0})
    decision = rollout.observe("sjf", {"error": 1.0})
    assert decision is not None and decision.reason == "candidate_failing"
    assert rollout.state.status == "rolled_back" and weights(arms)["sjf"] == 0


def test_failures_everywhere_are_not_the_candidates_alone() -> None:
    rollout, _ = controller(sync_every=10**9)
    for _ in range(50):
        rollout.observe("orca", {"error": 1.0})
        assert rollout.observe("sjf", {"error": 1.0}) is None
    assert rollout.state.status == "running"


@pytest.mark.parametrize("path", ["examples/rollout.yaml", "deploy/gateway-rollout.yaml"])
def test_the_documented_rollouts_compare_equal_loads(path: str) -> None:
    root = Path(__file__).resolve().parent.parent
    settings = Settings.load(config_file=root / path)
    assert settings.rollout is not None and settings.rollout.control is not None
    topology = settings.rollout_topology()
    weights = topology.weights(settings.rollout.steps[0])
    assert weights[settings.rollout.control] == weights[settings.rollout.candidate] == 5


def test_the_compose_rollout_overlay_adds_a_control_engine_like_the_baselines() -> None:
    root = Path(__file__).resolve().parent.parent
    overlay = yaml.safe_load((root / "compose.rollout.yaml").read_text())["services"]
    assert overlay["engine-orca-control"]["extends"] == {
        "file": "compose.yaml",
        "service": "engine-orca",
    }
    assert "engine-orca-control" in overlay["gateway"]["depends_on"]
    [mount] = overlay["gateway"]["volumes"]
    assert mount.startswith("./deploy/gateway-rollout.yaml:/etc/carousel/gateway.yaml")
