"""A step's evidence: each test's sufficient statistic, and how samples reach it.

`Tally` is what is shared between replicas and restarts: per test, the number of statistics
seen and the sum of log-wealth increments per bet (gateway/rollout/betting.py), plus each
arm's request and sample (unit) counts and the requests counted apart (pinned or continued:
served, never evidence). Sums are order-free, so tallies from several replicas just add.

`StepObserver` turns one replica's completed requests into tally increments. The arms are
the *reference* (the rollout's control arm, else its baseline) and the *candidate*.
- Units: the tests' unit is the unit the split randomises. With `assignment: user` every
  request of a user goes to the same arm, and a user's latencies share the user's prompts and
  habits, so its requests are not independent: each user contributes one sample per step, the
  summary of its first `requests_per_unit` requests of the step (the geometric mean of each
  latency, the share of errors, the share beyond a tail threshold); its later requests of the
  step count in `requests`, never in a test. Users are independent draws assigned by a hash
  of their name, so under "no difference" two users' samples are exchangeable whichever arm
  each is on, and every paired null below is exact whatever the users' own effects (the proof
  the request-level tests lacked: a few users' effects persist through a whole step).
- Requests without a user (a request without `user`, or any under `assignment: request`):
  an engine's queue and batch carry over from one request to the next, and both arms see one
  arrival process, so two engines' latencies drift with the load they share and with their
  own queues' memory; scored one request a sample, a test detects that drift even when the
  engines do not differ (scripts/rollout_sim.py: identical engines at a 50% step, 8 req/s, one
  request a sample: false advances and rollbacks in 17-23% of steps). So such requests form
  *blocks*: the step's compared requests, as this replica completes them, cut into blocks of
  `BLOCK_PER_UNIT * requests_per_unit`; in each block each arm's first `requests_per_unit`
  requests are that arm's one sample. The candidate's and the reference's samples of one block
  come from the same stretch of time, so the load they shared cancels in their pair, and
  blocks are far enough apart for the engines' memory to fade. This is a measured remedy, not
  a proof: the false rates return to alpha in the simulator (docs/rollout.md).
- Pairing (paired tests): per field, candidate samples wait in arrival order; each is paired
  with the most recent unpaired reference sample (older unpaired ones are dropped when more
  than `PAIR_BUFFER` wait). The choice depends on arrival order only, never on values, so
  under "no difference" each pair is exchangeable; pairing recent samples keeps a pair close
  in time when load drifts.
- Tail reference (tail tests): the reference's running `TAIL_QUANTILE` over its last
  `TAIL_WINDOW` requests of the step, recomputed every `TAIL_REFRESH` requests, once it has
  `TAIL_MIN_SAMPLES`; candidate requests seen before that are not scored.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gateway.rollout.betting import log_e_value, num_bets
from gateway.rollout.spec import TAIL_QUANTILE, RolloutSpec, TestSpec
from gateway.settings.rollout_metrics import E2E_MS, ERROR, SAMPLE_FIELDS, TPOT_MS, TTFT_MS

PAIR_BUFFER = 256
TAIL_WINDOW = 2000
TAIL_REFRESH = 250
TAIL_MIN_SAMPLES = 500
#: users followed in one step by one replica; a further user's requests are not scored
MAX_UNITS = 200_000
#: a block of requests without a user spans this many times `requests_per_unit` compared
#: requests (both arms)
BLOCK_PER_UNIT = 3
#: a client that went away (gateway/context.py's CLIENT_CLOSED; the rollout imports only
#: the settings, tests/test_layering.py)
CLIENT_CLOSED = 499
#: answers that are the client's own doing: they count for nothing (a disconnect included)
CLIENT_FAULTS = frozenset({400, 401, 403, 404, 413, 422, CLIENT_CLOSED})

Role = Literal["reference", "candidate"]
ROLES: tuple[Role, ...] = ("reference", "candidate")
Sample = dict[str, float]


def _zeros() -> dict[str, int]:
    return {"reference": 0, "candidate": 0}


@dataclass
class Tally:
    """Per test: statistics seen and log-wealth per bet; per arm: requests and units seen;
    per arm name: requests counted apart."""

    n: dict[str, int] = field(default_factory=dict)
    log_wealth: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=_zeros)
    units: dict[str, int] = field(default_factory=_zeros)
    apart: dict[str, int] = field(default_factory=dict)

    def add_increments(self, name: str, increments: np.ndarray) -> None:
        """Add (T, J) log-wealth increments of `name`'s test."""
        if increments.shape[0] == 0:
            return
        current = np.asarray(self.log_wealth.get(name, [0.0] * num_bets()))
        self.log_wealth[name] = (current + increments.sum(axis=0)).tolist()
        self.n[name] = self.n.get(name, 0) + int(increments.shape[0])

    def merge(self, other: Tally) -> None:
        """Add `other`'s statistics (another replica's, or a pending increment)."""
        for name, wealth in other.log_wealth.items():
            current = np.asarray(self.log_wealth.get(name, [0.0] * num_bets()))
            self.log_wealth[name] = (current + np.asarray(wealth)).tolist()
            self.n[name] = self.n.get(name, 0) + other.n.get(name, 0)
        for mine, theirs in ((self.requests, other.requests), (self.units, other.units),
                             (self.apart, other.apart)):  # fmt: skip
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count

    def log_e(self, name: str) -> float:
        wealth = self.log_wealth.get(name)
        return 0.0 if wealth is None else float(log_e_value(np.asarray(wealth)))

    def empty(self) -> bool:
        return not any(self.requests.values()) and not self.n and not any(self.apart.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "log_wealth": self.log_wealth,
            "requests": self.requests,
            "units": self.units,
            "apart": self.apart,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        return cls(
            dict(data["n"]),
            dict(data["log_wealth"]),
            _zeros() | dict(data["requests"]),
            _zeros() | dict(data.get("units", {})),
            dict(data.get("apart", {})),
        )


def request_sample(
    status: int, ttft_s: float | None, total_s: float, completion_tokens: int
) -> Sample:
    """A finished request as a sample. The client's own mistakes (`CLIENT_FAULTS`: 400, 401,
    403, 404, 413, 422, a disconnect) count for nothing; every other failure is the arm's
    error (a 429 for a full queue or a missed deadline, 503, any 5xx, a timeout, an unreachable
    upstream), with no latencies. TPOT is (e2e - TTFT) / (completion tokens - 1)."""
    if status in CLIENT_FAULTS:
        return {}
    if status >= 400:
        return {ERROR: 1.0}
    sample: Sample = {ERROR: 0.0, E2E_MS: total_s * 1000}
    if ttft_s is not None:
        sample[TTFT_MS] = ttft_s * 1000
        if completion_tokens > 1:
            sample[TPOT_MS] = (total_s - ttft_s) * 1000 / (completion_tokens - 1)
    return sample


@dataclass
class UnitSummary:
    """One unit's requests so far: log-latency sums, errors, tail exceedances."""

    requests: int = 0
    log_sum: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    errors: float = 0.0
    tail_sum: dict[str, float] = field(default_factory=dict)
    tail_count: dict[str, int] = field(default_factory=dict)

    def add(self, sample: Sample, tails: dict[str, float]) -> None:
        self.requests += 1
        self.errors += sample.get(ERROR, 0.0)
        for name, value in sample.items():
            if name != ERROR and math.isfinite(value) and value > 0:
                self.log_sum[name] = self.log_sum.get(name, 0.0) + math.log(value)
                self.count[name] = self.count.get(name, 0) + 1
        for name, value in tails.items():
            self.tail_sum[name] = self.tail_sum.get(name, 0.0) + value
            self.tail_count[name] = self.tail_count.get(name, 0) + 1

    def sample(self) -> Sample:
        """The unit's one sample: geometric mean latencies and the share of errors."""
        out = {name: math.exp(total / self.count[name]) for name, total in self.log_sum.items()}
        return out | {ERROR: self.errors / self.requests}

    def tail_shares(self) -> dict[str, float]:
        return {name: total / self.tail_count[name] for name, total in self.tail_sum.items()}


class TailReference:
    """The baseline's running quantile (see the module docstring); None until it has enough."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=TAIL_WINDOW)
        self._since = 0
        self.threshold: float | None = None

    def add(self, value: float) -> None:
        self._values.append(value)
        self._since += 1
        if len(self._values) >= TAIL_MIN_SAMPLES and (
            self.threshold is None or self._since >= TAIL_REFRESH
        ):
            self.threshold = float(np.quantile(np.asarray(self._values), TAIL_QUANTILE))
            self._since = 0


def tail_thresholds(base: np.ndarray) -> np.ndarray:
    """TailReference's threshold after each of the baseline samples `base` (NaN: none yet).

    The same rule vectorised over a whole stream, for scripts/rollout_sim.py."""
    out = np.full(base.size, np.nan)
    ends = np.arange(TAIL_MIN_SAMPLES, base.size + 1, TAIL_REFRESH)
    short, full = ends[ends < TAIL_WINDOW], ends[ends >= TAIL_WINDOW]
    values = [np.quantile(base[:end], TAIL_QUANTILE) for end in short]
    if full.size:
        windows = np.lib.stride_tricks.sliding_window_view(base, TAIL_WINDOW)[full - TAIL_WINDOW]
        values += list(np.quantile(windows, TAIL_QUANTILE, axis=1))  # (len(full),)
    for end, value in zip(ends, values, strict=True):
        out[end - 1 : end - 1 + TAIL_REFRESH] = value
    return out


class StepObserver:
    """One replica's view of a step: completed requests in, tally increments out."""

    def __init__(self, spec: RolloutSpec) -> None:
        self.spec = spec
        #: requests without a user seen in the step (both arms): their block is this // size
        self._anonymous = 0
        fields = {t.field for t in spec.tests if t.kind == "paired"}
        self._ref: dict[str, deque[float]] = {f: deque(maxlen=PAIR_BUFFER) for f in fields}
        self._cand: dict[str, deque[float]] = {f: deque(maxlen=PAIR_BUFFER) for f in fields}
        self._tails = {t.field: TailReference() for t in spec.tests if t.kind == "tail"}
        self._units: dict[tuple[Role, str], UnitSummary] = {}
        self._scored: set[tuple[Role, str]] = set()

    @property
    def requests_per_unit(self) -> int:
        return self.spec.settings.requests_per_unit

    def observe(self, arm: Role, sample: Sample, unit: str | None = None) -> Tally:
        """The tally increment of one completed request of `arm`; `unit`: the user it counts
        for (None: its block's, see the module docstring)."""
        tally = Tally()
        tally.requests[arm] += 1
        tails = self._tail_statistics(arm, sample)
        if unit is None:
            block = self._anonymous // (BLOCK_PER_UNIT * self.requests_per_unit)
            self._anonymous += 1
            key = (arm, f"#{block}")
        else:
            key = (arm, f"u:{unit}")
        if key in self._scored:
            return tally
        summary = self._units.get(key)
        if summary is None:
            if len(self._units) + len(self._scored) >= MAX_UNITS:
                return tally
            summary = self._units[key] = UnitSummary()
        summary.add(sample, tails)
        if summary.requests >= self.requests_per_unit:
            del self._units[key]
            self._scored.add(key)
            self._score(tally, arm, summary)
        return tally

    def _tail_statistics(self, arm: Role, sample: Sample) -> dict[str, float]:
        """Per tail test, this request's statistic (a reference request updates the tails)."""
        out: dict[str, float] = {}
        for name, reference in self._tails.items():
            value = sample.get(name, float("nan"))
            if not np.isfinite(value):
                continue
            if arm == "reference":
                reference.add(value)
                continue
            if reference.threshold is None:
                continue
            threshold, c = np.asarray([reference.threshold]), np.asarray([value])
            for test in self._tests(name, "tail"):
                out[test.name] = float(test.statistic(threshold, c)[0])
        return out

    def _tests(self, field_name: str, kind: str) -> list[TestSpec]:
        return [t for t in self.spec.tests if t.field == field_name and t.kind == kind]

    def _score(self, tally: Tally, arm: Role, unit: UnitSummary) -> None:
        """One unit's sample into the paired tests, its tail shares into the tail tests."""
        tally.units[arm] += 1
        sample = unit.sample()
        for name in SAMPLE_FIELDS:
            value = sample.get(name, float("nan"))
            if name in self._ref and np.isfinite(value):
                self._observe_pair(tally, arm, name, value)
        shares = unit.tail_shares()
        for test in self.spec.tests:
            share = shares.get(test.name)
            if test.kind == "tail" and share is not None:
                tally.add_increments(test.name, test.test.increments(np.asarray([share])))

    def _observe_pair(self, tally: Tally, arm: Role, name: str, value: float) -> None:
        if arm == "reference":
            self._ref[name].append(value)
        else:
            self._cand[name].append(value)
        while self._ref[name] and self._cand[name]:
            b = np.asarray([self._ref[name].pop()])  # the most recent reference sample
            c = np.asarray([self._cand[name].popleft()])  # the oldest waiting candidate
            for test in self._tests(name, "paired"):
                tally.add_increments(test.name, test.test.increments(test.statistic(b, c)))
