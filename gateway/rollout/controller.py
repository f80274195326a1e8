"""The live rollout: samples in, decisions out, arm weights set by the current step.

One `RolloutController` per deployment with a `rollout:` block. Each finished request that the
split sent to the candidate or to its reference (the control arm, else the baseline) becomes
a sample (TTFT, TPOT, e2e, error); its tally increment (gateway/rollout/evidence.py) is added
to the step's tally, and the decision rule (gateway/rollout/decision.py) is looked at after
every request. Only randomised traffic is evidence: a request pinned to an arm
(`X-Carousel-Arm`) or continuing a conversation on its arm (`previous_response_id`) is served
as always and counted apart. A request the split sent to an arm that could not take it (dead,
or not ready) is served by another and counts as an error of the arm it was sent to.

Users stay put: only the rollout's arms carry weight (gateway/settings/rollout_topology.py:
candidate `share`, the control as much, the baseline the rest), and with
`assignment: user` an arm is chosen by a user's fixed point in [0, 1) over the cumulative
weights (gateway/arms/choice.py), the candidate's slice last (gateway/app.py orders the arms
so), so as the candidate's share grows its slice only grows: a user moves to the candidate
once, and back only on a rollback.

Replicas and restarts (gateway/rollout/store.py): every `sync_every` samples a replica adds
its pending tally increment to the store's tally of the current epoch (a step, or a resumed
one), adopts the shared state if another replica or an operator changed it, and, if it holds
the lease, looks at the shared tally and acts; a decision is saved whole with a new epoch, as a
compare-and-set on the state's version (a writer that lost the race adopts the winner's state
and its decision is dropped). A restarted gateway reads the state back and resumes where it
stood.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.rollout.decision import Decision, decide
from gateway.rollout.evidence import Role, Sample, StepObserver, Tally
from gateway.rollout.spec import RolloutSpec, build_spec
from gateway.rollout.store import RolloutStore
from gateway.settings.rollout import RolloutSettings
from gateway.settings.rollout_metrics import ERROR
from gateway.settings.rollout_topology import RolloutTopology

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
    #: bumped by every save (the store's compare-and-set); 0: never saved
    carried: dict[str, float] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    version: int = 0
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
            "version": self.version,
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
            int(data.get("version", 0)),
        )

    def copy(self) -> RolloutState:
        return RolloutState.from_json(json.loads(json.dumps(self.to_json())))


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
        topology: RolloutTopology | None = None,
        notes: list[str] | None = None,
        measurement_ready: Callable[[str], bool] = lambda arm: True,
    ) -> None:
        self.model = model
        #: whether an arm's samples may count now (`Arm.measurement_ready`: not while its CPU
        #: kernels build in the background, its samples then spanning two paths)
        self.measurement_ready = measurement_ready
        #: randomised samples not counted because a compared arm was not ready, per arm
        self.held_samples: dict[str, int] = {}
        self.spec: RolloutSpec = build_spec(settings)
        #: the arms and their engines (default: one engine an arm)
        self.topology = topology or RolloutTopology.of(settings, {})
        self.arms = arms
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.sync_every = sync_every
        self.lease_s = lease_s
        #: what the operator should know from the start (tests that some traffic cannot feed)
        self.notes = list(notes or [])
        self.owner = uuid.uuid4().hex
        saved = store.load()
        self.state = RolloutState.from_json(saved) if saved else RolloutState(step_started=clock())
        if saved:
            self.state.tally = store.tally(self.state.epoch)
        self.observer = StepObserver(self.spec)
        self.pending = Tally()
        self._unsynced = 0
        #: the last requests on this replica of the candidate and of the other rollout arms:
        #: failed or not (the failing-arm rule)
        self._recent: dict[str, deque[bool]] = {
            side: deque(maxlen=FAILING_AFTER) for side in ("candidate", "others")
        }
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

    def weights(self) -> dict[str, float]:
        """Each rollout arm's share of traffic now (rollback and abort: all to the baseline)."""
        if self.state.status in ("rolled_back", "aborted"):
            return {name: 100.0 * (name == self.settings.baseline) for name in self.topology.arms}
        return self.topology.weights(self.share)

    def apply_weights(self) -> None:
        """Only the rollout's arms carry weight (see `weights`)."""
        weights = self.weights()
        for arm in self.arms:
            arm.weight = weights.get(arm.name, 0.0)
            if self.metrics is not None and arm.name in weights:
                self.metrics.weight.labels(self.model, arm.name).set(arm.weight)
        if self.metrics is not None:
            self.metrics.step.labels(self.model).set(self.state.step)

    def role(self, arm: str) -> Role | None:
        """The arm's part in the tests: "candidate", "reference" (control, else baseline)."""
        if arm == self.settings.candidate:
            return "candidate"
        return "reference" if arm == self.topology.reference else None

    def observe(
        self, arm: str, sample: Sample, unit: str | None = None, randomised: bool = True
    ) -> Decision | None:
        """Count one finished request of `arm` (`unit`: the user it counts for, None: its
        block's, gateway/rollout/evidence.py; not `randomised`: pinned or continued, counted
        apart); the decision it led to."""
        role = self.role(arm)
        if not sample or self.state.status not in ("running", "held"):
            return None
        failed = sample.get(ERROR, 0.0) > 0
        if randomised and arm != self.settings.candidate and arm in self.topology.engines:
            self._recent["others"].append(failed)
        if role is None:
            return None
        if not randomised:
            self.pending.apart[arm] = self.pending.apart.get(arm, 0) + 1
            return None
        if self.unready_arms():  # NOTE: the failing-arm rule still sees the candidate's
            self.held_samples[arm] = self.held_samples.get(arm, 0) + 1
            if role == "candidate":
                self._recent["candidate"].append(failed)
            return self._rollback_failing() if self._failing() else None
        if self.settings.assignment == "request":
            unit = None
        self.pending.merge(self.observer.observe(role, sample, unit))
        self._unsynced += 1
        if role == "candidate":
            self._recent["candidate"].append(failed)
        if self._failing():
            return self._rollback_failing()
        return self.sync() if self._unsynced >= self.sync_every else None

    def unready_arms(self) -> list[str]:
        """The compared arms (candidate, reference) whose measurements may not count now: the
        rollout holds (counts no sample of either) until none is left."""
        compared = (self.settings.candidate, self.topology.reference)
        return [arm for arm in compared if not self.measurement_ready(arm)]

    def _held_notes(self) -> list[str]:
        """Why samples are not counted (the status says it, never silently)."""
        unready = self.unready_arms()
        held = sum(self.held_samples.values())
        if not unready and not held:
            return []
        now = (
            f"holding: the CPU kernels of {', '.join(unready)} are building (torch's ops serve "
            "meanwhile), so no sample counts until they serve; "
            if unready
            else ""
        )
        return [f"{now}{held} randomised samples not counted while an arm's kernels built"]

    def _failing(self) -> bool:
        """The candidate's last `FAILING_AFTER` requests all failed while the other rollout
        arms' (control and baseline) last as many all succeeded (on this replica)."""
        cand, others = self._recent["candidate"], self._recent["others"]
        full = len(cand) == len(others) == FAILING_AFTER
        return full and all(cand) and not any(others)

    def _rollback_failing(self) -> Decision | None:
        """A candidate that stopped answering is rolled back at once, by any replica (the
        compare-and-set keeps a concurrent decision from being overwritten)."""
        if not self._refresh():
            return None
        log_e = {t.name: self.state.tally.log_e(t.name) for t in self.spec.tests}
        if not self._act("rollback", "candidate_failing", log_e):
            return None
        return Decision("rollback", "candidate_failing")

    def sync(self) -> Decision | None:
        """Add this replica's samples to the store, adopt the shared state, and, holding the
        lease, decide on the shared tally."""
        if not self._refresh(needs_lease=True):
            return None
        return self.look()

    def _refresh(self, needs_lease: bool = False) -> bool:
        """Add this replica's samples to the store and adopt the shared state; if the rollout
        still runs (and, `needs_lease`, this replica holds the decider's lease), read the
        shared tally: True, a decision may be taken on it."""
        self._flush()
        self.adopt()
        if self.state.status not in ("running", "held"):
            return False
        if needs_lease and not self.store.lease(self.owner, self.lease_s):
            return False
        self.state.tally = self.store.tally(self.state.epoch)
        return True

    def _flush(self) -> None:
        self.store.add_tally(self.state.epoch, self.pending)
        self.pending, self._unsynced = Tally(), 0

    def adopt(self) -> None:
        """Take the store's state if someone else changed it (a decision, a command)."""
        shared = self.store.load()
        if shared is None or shared.get("version", 0) == self.state.version:
            return
        epoch = self.state.epoch
        self.state = RolloutState.from_json(shared)
        self.state.tally = self.store.tally(self.state.epoch)
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
            tally.requests["reference"],
            tally.requests["candidate"],
            log_e,
            self.clock() - self.state.step_started,
            self.state.carried,
        )
        if decision is None or (decision.kind == "hold" and self.state.status == "held"):
            return None
        return decision if self._act(decision.kind, decision.reason, log_e) else None

    def _act(self, kind: str, reason: str, log_e: dict[str, float]) -> bool:
        """Apply `kind` to a copy of the state and save it as a compare-and-set; False (and
        the store's state adopted) when another writer saved first."""
        before = self.state
        state = before.copy()
        entry = {
            "time": self.clock(),
            "kind": kind,
            "reason": reason,
            "replica": self.owner,
            "step": state.step,
            "share": self.share,
            "n": dict(before.tally.requests),
            "e_values": {k: _e_value(v + state.carried.get(k, 0.0)) for k, v in log_e.items()},
        }
        if kind in ("advance", "resume"):  # the step's guardrail evidence carries on
            for test in self.spec.of_role("guardrail"):
                state.carried[test.name] = state.carried.get(test.name, 0.0) + log_e[test.name]
        if kind == "advance":
            state.step += 1
            if state.step == len(self.settings.steps) - 1:
                state.status = "promoted"
        else:
            state.status = cast(Status, _STATUS_AFTER[kind])
        if kind in ("advance", "resume"):
            state.step_started = self.clock()
            state.epoch += 1
        state.decisions.append(entry)
        if not self.store.save(state.to_json(), before.version):
            self.adopt()
            return False
        state.version = before.version + 1
        if state.epoch == before.epoch:
            state.tally = before.tally
        else:
            self.pending, self.observer = Tally(), StepObserver(self.spec)
        self.state = state
        log.info("rollout_decision", model=self.model, **entry)
        if self.metrics is not None:
            self.metrics.decisions.labels(self.model, kind).inc()
        self.apply_weights()
        return True

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
        self._flush()
        for _ in range(COMMAND_TRIES):
            self.adopt()
            if self.state.status not in allowed[action]:
                raise ValueError(f"cannot {action} a rollout that is {self.state.status}")
            tally = self.store.tally(self.state.epoch)
            log_e = {t.name: tally.log_e(t.name) for t in self.spec.of_role("guardrail")}
            if self._act(action, "operator", log_e):
                return
        raise ValueError(f"cannot {action} now: the rollout's state keeps changing; try again")

    def save(self) -> None:
        """Write the state as it stands (a first save of a new rollout)."""
        if self.store.save(self.state.to_json(), self.state.version):
            self.state.version += 1

    def status(self) -> dict[str, Any]:
        """What `carousel rollout status` shows (the shared tally, with this replica's
        samples not yet synced)."""
        self.adopt()
        tally = self.store.tally(self.state.epoch)
        tally.merge(self.pending)
        s = self.settings
        return {
            "model": self.model,
            "baseline": s.baseline,
            "candidate": s.candidate,
            "control": s.control,
            "compared": [s.candidate, self.topology.reference],
            "assignment": s.assignment,
            "unit": _unit_text(s),
            "status": self.state.status,
            "replica": self.owner,
            "decider": self.store.lease_holder(),
            "step": self.state.step,
            "steps": s.steps,
            "candidate_share": self.share,
            "weights": self.weights(),
            "step_age_s": round(self.clock() - self.state.step_started, 3),
            "n": dict(tally.requests),
            "units": dict(tally.units),
            "not_randomised": dict(tally.apart),
            "e_values": {t.name: _e_value(tally.log_e(t.name)) for t in self.spec.tests},
            "samples": {t.name: tally.n.get(t.name, 0) for t in self.spec.tests},
            "carried": {k: _e_value(v) for k, v in self.state.carried.items()},
            "measurement_held": {"arms": self.unready_arms(), "samples": dict(self.held_samples)},
            "notes": self.notes + self._held_notes() + self._empty_tests(tally),
            "decisions": self.state.decisions,
        }

    def _empty_tests(self, tally: Tally) -> list[str]:
        """Tests with no sample while the arms have had plenty (say why, never stay silent)."""
        if min(tally.units.values()) < EMPTY_TEST_UNITS:
            return []
        return [
            f"the test `{t.name}` has no samples after {sum(tally.units.values())} units"
            for t in self.spec.tests
            if t.kind == "paired" and not tally.n.get(t.name)
        ]


#: a candidate whose last this-many randomised requests failed while the other rollout arms'
#: last as many succeeded has stopped answering: rolled back without waiting for a test (under "no
#: difference" with independent failures at rate e that takes e^10 (1 - e)^10 at a look:
#: 1.6e-7 at e = 0.3)
FAILING_AFTER = 10
#: operator commands retried this often when another writer keeps winning the race
COMMAND_TRIES = 5
#: units per arm after which a paired test with no sample is named in the status
EMPTY_TEST_UNITS = 50
_STATUS_AFTER = {
    "rollback": "rolled_back",
    "promote": "promoted",
    "hold": "held",
    "abort": "aborted",
    "pause": "paused",
    "resume": "running",
}


def _unit_text(settings: RolloutSettings) -> str:
    """The tests' unit, as the status says it (gateway/rollout/evidence.py)."""
    first = f"first {settings.requests_per_unit}"
    block = f"a block's {first} requests an arm"
    if settings.assignment == "request":
        return block
    return f"a user's {first} requests of the step (without `user`: {block})"


def _e_value(log_e: float) -> float:
    return round(math.exp(min(log_e, 700.0)), 4)
