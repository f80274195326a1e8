"""A rollout counts no sample while a compared arm's CPU kernels build in the background:
its samples would span two paths (torch's ops, then the kernels'). It says so in its status."""

from __future__ import annotations

from gateway.rollout.controller import RolloutController
from gateway.rollout.store import MemoryRolloutStore
from tests.test_rollout_controller import ROLLOUT, FakeArm

SAMPLE = {"ttft_ms": 200.0, "tpot_ms": 20.0, "e2e_ms": 700.0, "error": 0.0}


def test_the_rollout_holds_while_an_arm_builds_and_counts_once_it_serves() -> None:
    building = {"sjf"}
    arms = [FakeArm("orca"), FakeArm("other"), FakeArm("sjf")]
    rollout = RolloutController(
        "m", ROLLOUT, arms, MemoryRolloutStore(),  # type: ignore[arg-type]
        sync_every=1, measurement_ready=lambda arm: arm not in building,
    )  # fmt: skip
    for arm in ("orca", "sjf", "orca"):
        rollout.observe(arm, SAMPLE)
    status = rollout.status()
    assert sum(status["n"].values()) == 0 and status["measurement_held"] == {
        "arms": ["sjf"],
        "samples": {"orca": 2, "sjf": 1},
    }
    assert any("kernels of sjf are building" in note for note in status["notes"])

    building.clear()  # the kernels serve now
    for arm in ("orca", "sjf"):
        rollout.observe(arm, SAMPLE)
    status = rollout.status()
    assert sum(status["n"].values()) == 2
    assert status["measurement_held"]["arms"] == []
    assert any("3 randomised samples not counted" in note for note in status["notes"])


def test_a_candidate_failing_everything_is_rolled_back_even_while_held() -> None:
    arms = [FakeArm("orca"), FakeArm("other"), FakeArm("sjf")]
    rollout = RolloutController(
        "m", ROLLOUT, arms, MemoryRolloutStore(),  # type: ignore[arg-type]
        sync_every=1, measurement_ready=lambda arm: arm != "sjf",
    )  # fmt: skip
    for _ in range(200):
        rollout.observe("sjf", {**SAMPLE, "error": 1.0})
        rollout.observe("orca", SAMPLE)
        if rollout.state.status != "running":
            break
    assert rollout.state.status == "rolled_back"
