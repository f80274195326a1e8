"""The live rollout: samples in, decisions out, arm weights set by the current step.

One `RolloutController` per deployment with a `rollout:` block. Each finished request of the
baseline or candidate arm becomes a sample (TTFT, TPOT, e2e, error); its tally increment
(gateway/rollout/evidence.py) is added to the step's tally, and the decision rule
(gateway/rollout/decision.py) is looked at after every request.

Users stay put: only the two arms carry weight during the rollout (baseline 100 - share,
candidate share), and an arm is chosen by a user's fixed point in [0, 1) over the cumulative
weights (gateway/arms/choice.py), so as the candidate's share grows its slice only grows: a
user moves from baseline to candidate once, and back only on a rollback.

Replicas and restarts (gateway/rollout/store.py): every `sync_every` samples a replica adds
its pending tally increment to the store's tally of the current epoch (a step, or a resumed
one), adopts the shared state if another replica or an operator changed it, and, if it holds
the lease, looks at the shared tally and acts; a decision is saved whole with a new epoch. A
restarted gateway reads the state back and resumes where it stood.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.rollout.decision import Decision, decide
from gateway.rollout.evidence import Sample, StepObserver, Tally
from gateway.rollout.spec import RolloutSpec, build_spec
from gateway.rollout.store import RolloutStore
from gateway.settings.rollout import RolloutSettings

log = structlog.get_logger("carousel.rollout")

Status = Literal["running", "held", "paused", "rolled_back", "promoted", "aborted"]
FINAL: tuple[Status, ...] = ("rolled_back", "promoted", "aborted")
#: samples between syncs with the store (each sync may decide)
SYNC_EVERY = 20
#: the decider's lease, renewed at every sync
LEASE_S = 10.0
#: what a logged decision may be: the rule's, then an operator's
DECISION_KINDS = ("advance", "rollback", "promote", "hold", "pause", "resume", "abort")


class WeightedArm(Protocol):
    """What the controller needs of an arm: its name and a settable weight."""

    name: str
    weight: float


@dataclass
class RolloutState:
    """Everything that must survive a restart (and is shared by replicas through the store)."""

    step: int = 0
    status: Status = "running"
    step_started: float = field(default_factory=time.time)
    #: which tally in the store counts now (a new one at each advance or resume)
    epoch: int = 0
    carried: dict[str, float] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    #: the epoch's shared tally as last read (not saved: the store keeps it)
    tally: Tally = field(default_factory=Tally)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "status": self.status,
            "step_started": self.step_started,
            "epoch": self.epoch,
            "carried": self.carried,
            "decisions": self.decisions,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        return cls(
            data["step"],
            data["status"],
            data["step_started"],
            data["epoch"],
            dict(data["carried"]),
            list(data["decisions"]),
        )


class RolloutMetrics:
    """The rollout's Prometheus series, on the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Gauge(
            "carousel_rollout_step", "The rollout's current step (0-based)", ["model"],
            registry=registry,
        )  # fmt: skip
        self.weight = Gauge(
            "carousel_rollout_arm_weight", "Each rollout arm's share of traffic, percent",
            ["model", "arm"], registry=registry,
        )  # fmt: skip
        self.decisions = Counter(
            "carousel_rollout_decisions", "Rollout decisions by kind", ["model", "kind"],
            registry=registry,
        )  # fmt: skip

    def start(self, model: str) -> None:
        """Every decision kind's counter at 0 from the start, so a dashboard's query and a
        rate over it have a series before the first decision."""
        for kind in DECISION_KINDS:
            self.decisions.labels(model, kind)


class RolloutController:
    """Drives one deployment's rollout (see the module docstring)."""

    def __init__(
        self,
        model: str,
        settings: RolloutSettings,
        arms: list[WeightedArm],
        store: RolloutStore,
        metrics: RolloutMetrics | None = None,
        clock: Callable[[], float] = time.time,
        sync_every: int = SYNC_EVERY,
        lease_s: float = LEASE_S,
    ) -> None:
        self.model = model
        self.spec: RolloutSpec = build_spec(settings)
        self.arms = arms
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.sync_every = sync_every
        self.lease_s = lease_s
        self.owner = uuid.uuid4().hex
        saved = store.load()
        self.state = RolloutState.from_json(saved) if saved else RolloutState(step_started=clock())
        if saved:
            self.state.tally = store.tally(self.state.epoch)
        self.observer = StepObserver(self.spec)
        self.pending = Tally()
        self._unsynced = 0
        if metrics is not None:
            metrics.start(model)
        self.apply_weights()

    @property
    def settings(self) -> RolloutSettings:
        return self.spec.settings

    @property
    def share(self) -> float:
        """The candidate's share of traffic now, percent."""
        if self.state.status in ("rolled_back", "aborted"):
            return 0.0
        if self.state.status == "promoted":
            return 100.0
        return self.settings.steps[self.state.step]

    def apply_weights(self) -> None:
        """Only the two arms carry weight: baseline 100 - share, candidate share."""
        weights = {self.settings.baseline: 100 - self.share, self.settings.candidate: self.share}
        for arm in self.arms:
            arm.weight = weights.get(arm.name, 0.0)
            if self.metrics is not None and arm.name in weights:
                self.metrics.weight.labels(self.model, arm.name).set(arm.weight)
        if self.metrics is not None:
            self.metrics.step.labels(self.model).set(self.state.step)

    def observe(self, arm: str, sample: Sample) -> Decision | None:
        """Count one finished request of `arm`; the decision it led to, if any."""
        role = {self.settings.baseline: "baseline", self.settings.candidate: "candidate"}.get(arm)
        if role is None or not sample or self.state.status not in ("running", "held"):
            return None
        self.pending.merge(self.observer.observe(role, sample))
        self._unsynced += 1
        return self.sync() if self._unsynced >= self.sync_every else None

    def sync(self) -> Decision | None:
        """Add this replica's samples to the store, adopt the shared state, and, holding the
        lease, decide on the shared tally."""
        self.store.add_tally(self.state.epoch, self.pending)
        self.pending, self._unsynced = Tally(), 0
        self.adopt()
        if self.state.status not in ("running", "held"):
            return None
        if not self.store.lease(self.owner, self.lease_s):
            return None
        self.state.tally = self.store.tally(self.state.epoch)
        return self.look()

    def adopt(self) -> None:
        """Take the store's state if someone else changed it (a decision, a command)."""
        shared = self.store.load()
        if shared is None:
            return
        if shared["epoch"] == self.state.epoch and len(shared["decisions"]) == len(
            self.state.decisions
        ):
            return
        epoch = self.state.epoch
        self.state = RolloutState.from_json(shared)
        if self.state.epoch != epoch:
            self.observer, self.pending = StepObserver(self.spec), Tally()
        self.apply_weights()

    def look(self) -> Decision | None:
        """Apply the decision rule now; act on what it decides."""
        tally = self.state.tally
        log_e = {t.name: tally.log_e(t.name) for t in self.spec.tests}
        if self.state.status == "held":  # only the guardrails still act
            log_e = {t.name: log_e[t.name] for t in self.spec.of_role("guardrail")}
        decision = decide(
            self.spec,
            tally.requests["baseline"],
            tally.requests["candidate"],
            log_e,
            self.clock() - self.state.step_started,
            self.state.carried,
        )
        if decision is None or (decision.kind == "hold" and self.state.status == "held"):
            return None
        self._act(decision.kind, decision.reason, log_e)
        return decision

    def _act(self, kind: str, reason: str, log_e: dict[str, float]) -> None:
        state = self.state
        entry = {
            "time": self.clock(),
            "kind": kind,
            "reason": reason,
            "replica": self.owner,
            "step": state.step,
            "share": self.share,
            "n": dict(state.tally.requests),
            "e_values": {k: _e_value(v + state.carried.get(k, 0.0)) for k, v in log_e.items()},
        }
        if kind == "advance":
            for test in self.spec.of_role("guardrail"):
                state.carried[test.name] = state.carried.get(test.name, 0.0) + log_e[test.name]
            state.step += 1
            if state.step == len(self.settings.steps) - 1:
                state.status = "promoted"
        else:
            state.status = cast(
                Status,
                {
                    "rollback": "rolled_back",
                    "promote": "promoted",
                    "hold": "held",
                    "abort": "aborted",
                    "pause": "paused",
                    "resume": "running",
                }[kind],
            )
        if kind in ("advance", "resume"):
            state.step_started = self.clock()
            state.epoch += 1
            state.tally, self.pending = Tally(), Tally()
            self.observer = StepObserver(self.spec)
        state.decisions.append(entry)
        log.info("rollout_decision", model=self.model, **entry)
        if self.metrics is not None:
            self.metrics.decisions.labels(self.model, kind).inc()
        self.apply_weights()
        self.save()

    def command(self, action: str) -> None:
        """An operator's `pause`, `resume`, `abort` or `promote` (ValueError if not now)."""
        allowed = {
            "pause": ("running", "held"),
            "resume": ("paused", "held"),
            "abort": ("running", "held", "paused"),
            "promote": ("running", "held", "paused"),
        }
        if action not in allowed:
            raise ValueError(f"unknown action `{action}`; valid: {', '.join(allowed)}")
        self.adopt()
        if self.state.status not in allowed[action]:
            raise ValueError(f"cannot {action} a rollout that is {self.state.status}")
        self._act(action, "operator", {})

    def save(self) -> None:
        self.store.save(self.state.to_json())

    def status(self) -> dict[str, Any]:
        """What `carousel rollout status` shows (the shared tally, with this replica's
        samples not yet synced)."""
        self.adopt()
        tally = self.store.tally(self.state.epoch)
        tally.merge(self.pending)
        return {
            "model": self.model,
            "baseline": self.settings.baseline,
            "candidate": self.settings.candidate,
            "status": self.state.status,
            "replica": self.owner,
            "decider": self.store.lease_holder(),
            "step": self.state.step,
            "steps": self.settings.steps,
            "candidate_share": self.share,
            "step_age_s": round(self.clock() - self.state.step_started, 3),
            "n": dict(tally.requests),
            "e_values": {t.name: _e_value(tally.log_e(t.name)) for t in self.spec.tests},
            "decisions": self.state.decisions,
        }


def _e_value(log_e: float) -> float:
    return round(math.exp(min(log_e, 700.0)), 4)
