"""End to end: two gateway replicas share one rollout in Redis; the deciding one is killed.

Issue 41: "killing the deciding replica mid-rollout leaves the other to finish it with no step
skipped or repeated". Two `carousel serve --config` processes with the same `rollout:` and the
same `--redis-url redis://...`, each under its own `carousel bench` load, roll out from a
slow sim process to a 3x faster one in two advances (50% -> 75% -> 100%). Once the first
advance is made, the replica holding the decider's lease (`decider` in `/admin/rollout`) is
killed by its pid (SIGKILL: no clean shutdown, its lease left to expire); the survivor takes
the lease over and promotes. The decision log then holds each step exactly once, in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.serve_process import Served, carousel_process, carousel_serves, serve_processes, stop
from tests.test_rollout_e2e import FAST, SLOW, bench_load, rollout_status, rollout_yaml, sim_args

#: the lease (gateway/rollout/controller.py LEASE_S, 10 s) must expire before the survivor decides
DEADLINE_S = 90.0


def _until(url: str, done: Callable[[dict[str, Any]], bool], deadline: float) -> dict[str, Any]:
    """Poll `url`'s rollout status until `done(status)` holds; fails at the deadline."""
    while True:
        status = rollout_status(url)
        if done(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.3)


def _deciding(replicas: list[Served], deadline: float) -> tuple[Served, Served]:
    """(the replica holding the decider's lease, the other one)."""
    while True:
        statuses = [rollout_status(r.url) for r in replicas]
        holder = statuses[0]["decider"]
        for index, status in enumerate(statuses):
            if status["replica"] == holder:
                return replicas[index], replicas[1 - index]
        assert time.monotonic() < deadline, statuses  # nobody holds it right now: look again
        time.sleep(0.3)


@pytest.mark.slow
def test_killing_the_deciding_replica_leaves_the_other_to_finish(
    tmp_path: Path, redis_url: str
) -> None:
    arms = [(sim_args(SLOW), "baseline"), (sim_args(FAST), "candidate")]
    arms.append((sim_args(SLOW), "control"))
    deadline = time.monotonic() + DEADLINE_S
    with carousel_serves(arms, tmp_path) as (baseline, candidate, control):
        config = tmp_path / "rollout.yaml"
        steps = "[25, 50, 100]"  # two advances, each step's tests at equal load
        config.write_text(rollout_yaml(baseline, candidate, "replicated", steps, control))
        gateway = ["--config", str(config), "--redis-url", redis_url]
        runs = [(gateway, "gateway-a"), (gateway, "gateway-b")]
        with serve_processes(runs, tmp_path) as replicas, ExitStack() as loads:
            benches = {
                r.url: loads.enter_context(
                    carousel_process(
                        bench_load(r.url, "replicated", tmp_path, name), tmp_path, name
                    )
                )
                for r, name in zip(replicas, ("bench-a", "bench-b"), strict=True)
            }
            mid = _until(replicas[0].url, lambda s: s["step"] == 1, deadline)
            assert mid["status"] == "running", mid  # mid-rollout: one advance of two
            dead, survivor = _deciding(replicas, deadline)
            dead.proc.kill()  # SIGKILL by its pid: no shutdown, its lease left to expire
            dead.proc.wait()
            stop(benches[dead.url])
            final = _until(survivor.url, lambda s: s["status"] != "running", deadline)
    assert final["status"] == "promoted", final
    decisions = final["decisions"]
    assert [(d["kind"], d["step"]) for d in decisions] == [("advance", 0), ("advance", 1)]
    survivor_id = final["replica"]
    assert decisions[-1]["replica"] == survivor_id  # the survivor finished it
    print(
        "deciders:", [d["replica"] == survivor_id and "survivor" or "killed" for d in decisions],
        "n per step:", [d["n"] for d in decisions],
    )  # fmt: skip
