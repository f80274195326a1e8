"""A step's evidence: each test's sufficient statistic, and how samples reach it.

`Tally` is what is shared between replicas and restarts: per test, the number of statistics
seen and the sum of log-wealth increments per bet (gateway/rollout/betting.py), plus each
arm's request count. Sums are order-free, so tallies from several replicas just add.

`StepObserver` turns one replica's completed requests into tally increments:
- Pairing (paired tests): per field, candidate samples wait in arrival order; each is paired
  with the most recent unpaired baseline sample (older unpaired ones are dropped when more
  than `PAIR_BUFFER` wait). The choice depends on arrival order only, never on values, so
  under "no difference" each pair is exchangeable; pairing recent samples keeps a pair close
  in time when load drifts.
- Tail reference (tail tests): the baseline's running `TAIL_QUANTILE` over its last
  `TAIL_WINDOW` samples of the step, recomputed every `TAIL_REFRESH` samples, once it has
  `TAIL_MIN_SAMPLES`; candidate samples seen before that are not scored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.rollout.betting import log_e_value, num_bets
from gateway.rollout.spec import SAMPLE_FIELDS, TAIL_QUANTILE, RolloutSpec, TestSpec

PAIR_BUFFER = 256
TAIL_WINDOW = 2000
TAIL_REFRESH = 250
TAIL_MIN_SAMPLES = 500

Sample = dict[str, float]


@dataclass
class Tally:
    """Per test: statistics seen and log-wealth per bet; per arm: requests seen."""

    n: dict[str, int] = field(default_factory=dict)
    log_wealth: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=lambda: {"baseline": 0, "candidate": 0})

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
        for arm, count in other.requests.items():
            self.requests[arm] = self.requests.get(arm, 0) + count

    def log_e(self, name: str) -> float:
        wealth = self.log_wealth.get(name)
        return 0.0 if wealth is None else float(log_e_value(np.asarray(wealth)))

    def empty(self) -> bool:
        return not any(self.requests.values()) and not self.n

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "log_wealth": self.log_wealth, "requests": self.requests}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        return cls(dict(data["n"]), dict(data["log_wealth"]), dict(data["requests"]))


def request_sample(
    status: int, ttft_s: float | None, total_s: float, completion_tokens: int
) -> Sample:
    """A finished request as a sample: a 5xx is an error (no latencies), a 4xx is the
    client's and counts for nothing; TPOT is (e2e - TTFT) / (completion tokens - 1)."""
    if status >= 500:
        return {"error": 1.0}
    if status >= 400:
        return {}
    sample: Sample = {"error": 0.0, "e2e_ms": total_s * 1000}
    if ttft_s is not None:
        sample["ttft_ms"] = ttft_s * 1000
        if completion_tokens > 1:
            sample["tpot_ms"] = (total_s - ttft_s) * 1000 / (completion_tokens - 1)
    return sample


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
        fields = {t.field for t in spec.tests}
        self._base: dict[str, deque[float]] = {f: deque(maxlen=PAIR_BUFFER) for f in fields}
        self._cand: dict[str, deque[float]] = {f: deque(maxlen=PAIR_BUFFER) for f in fields}
        self._tails = {t.field: TailReference() for t in spec.tests if t.kind == "tail"}

    def observe(self, arm: str, sample: Sample) -> Tally:
        """The tally increment of one completed request of `arm` ("baseline"/"candidate")."""
        tally = Tally()
        tally.requests[arm] += 1
        for name in SAMPLE_FIELDS:
            value = sample.get(name, float("nan"))
            if not np.isfinite(value):
                continue
            if name in self._tails:
                self._observe_tail(tally, arm, name, value)
            if name in self._base:
                self._observe_pair(tally, arm, name, value)
        return tally

    def _tests(self, field_name: str, kind: str) -> list[TestSpec]:
        return [t for t in self.spec.tests if t.field == field_name and t.kind == kind]

    def _observe_pair(self, tally: Tally, arm: str, name: str, value: float) -> None:
        if arm == "baseline":
            self._base[name].append(value)
        else:
            self._cand[name].append(value)
        while self._base[name] and self._cand[name]:
            b = np.asarray([self._base[name].pop()])  # the most recent baseline sample
            c = np.asarray([self._cand[name].popleft()])  # the oldest waiting candidate
            for test in self._tests(name, "paired"):
                tally.add_increments(test.name, test.test.increments(test.statistic(b, c)))

    def _observe_tail(self, tally: Tally, arm: str, name: str, value: float) -> None:
        reference = self._tails[name]
        if arm == "baseline":
            reference.add(value)
            return
        if reference.threshold is None:
            return
        threshold, c = np.asarray([reference.threshold]), np.asarray([value])
        for test in self._tests(name, "tail"):
            tally.add_increments(test.name, test.test.increments(test.statistic(threshold, c)))
