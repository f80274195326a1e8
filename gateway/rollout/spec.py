"""The tests a rollout runs at each step, built from its `rollout:` settings.

Every test is a one-sided betting test of a bounded mean (gateway/rollout/betting.py) on a
per-request statistic:

- Paired statistics. The k-th candidate sample of a step is paired with a baseline sample
  chosen by arrival order only (gateway/rollout/evidence.py), never by value, so when the arms
  do not differ each pair's order is a fair coin and every null below is exact.
  - target `*_p50` (lower is better): z = 1[c < b] (+1/2 on a tie); "better" rejects
    H0: P(c < b) <= 1/2, a sequential sign test of the median difference.
  - equivalence ("no difference") for a `*_p50` target: two one-sided tests (TOST) rejecting
    P(c < b) >= 1/2 + margin and P(c < b) <= 1/2 - margin, each at alpha.
  - guardrail `*_p50` with tolerance r: y = 1[c > (1 + r) b]; rejects H0: P(c > (1+r) b) <=
    1/2, which for a scale family is "the candidate's median is more than (1 + r) times the
    baseline's".
  - guardrail `error_rate` with tolerance d: e_c - e_b in {-1, 0, 1}; rejects H0: the
    candidate's error rate exceeds the baseline's by at most d.
  - target `error_rate` (`goodput` in earlier versions): e_b - e_c; "better" rejects H0: the
    candidate's error rate is not below the baseline's.
  - regression on the target (`regression_<metric>`, a guardrail of tolerance 0, 0.10 for a
    `*_p99` target, unless the guardrails already watch the target's metric): rejects H0:
    the candidate is not worse on the target itself, so a candidate significantly worse on
    what it was meant to improve is rolled back, not held.
- Tail statistics. A 0.99-quantile confidence sequence is far too wide to decide anything in a
  few thousand requests, so a p99 is judged by the share of candidate requests beyond the
  baseline's running p99 (times 1 + r for a guardrail): guardrail `*_p99` rejects H0: that
  share is at most 1%; target `ttft_p99` rejects H0: it is at least 1%. The baseline's p99 is
  an estimate (TailReference), so this null is approximate; scripts/rollout_sim.py measures
  the resulting error rates.

Here "baseline" means the reference the candidate is compared with: the rollout's `control`
arm when it has one, else its baseline (gateway/settings/rollout_topology.py); a sample is a
request, or a user's first requests of the step (gateway/rollout/evidence.py).

Error rates: the advance test and each equivalence test run at `alpha`; the guardrails share
`alpha` (Bonferroni), and a guardrail's e-value carries from step to step by multiplication,
so a false rollback anywhere in the rollout has probability at most `alpha`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gateway.rollout.betting import MeanTest
from gateway.settings.rollout import RolloutSettings
from gateway.settings.rollout_metrics import BY_NAME, TPOT_MS, TTFT_MS

#: "no difference": P(candidate < baseline) within 1/2 +- this
EQUIVALENCE_MARGIN = 0.05
#: the tail tests' quantile, and the null share of candidate requests beyond it
TAIL_QUANTILE = 0.99
#: the implicit regression guardrail of a `*_p99` target: its reference p99 is an estimate,
#: so a tolerance of 0 would put A/A at the edge of the null
REGRESSION_P99_TOLERANCE = 0.10

Role = Literal["target", "equivalence", "guardrail"]
Statistic = Callable[[np.ndarray, np.ndarray], np.ndarray]


def below(scale: float = 1.0) -> Statistic:
    """z = 1[c < scale b], a tie counting one half."""

    def statistic(b: np.ndarray, c: np.ndarray) -> np.ndarray:
        return (c < scale * b) + 0.5 * (c == scale * b)

    return statistic


def above(scale: float = 1.0) -> Statistic:
    """y = 1[c > scale b], a tie counting one half."""

    def statistic(b: np.ndarray, c: np.ndarray) -> np.ndarray:
        return (c > scale * b) + 0.5 * (c == scale * b)

    return statistic


def negated_below(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return -below()(b, c)


def difference(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.asarray(c - b, dtype=float)


def reverse_difference(b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.asarray(b - c, dtype=float)


def exceeds(scale: float = 1.0) -> Statistic:
    """1[c > scale * threshold] (the threshold is the baseline's running p99)."""

    def statistic(threshold: np.ndarray, c: np.ndarray) -> np.ndarray:
        return np.asarray(c > scale * threshold, dtype=float)

    return statistic


def within_tail(threshold: np.ndarray, c: np.ndarray) -> np.ndarray:
    return -exceeds()(threshold, c)


@dataclass(frozen=True)
class TestSpec:
    """One test of a step: its statistic over which field, and its null (a `MeanTest`)."""

    name: str
    role: Role
    field: str
    kind: Literal["paired", "tail"]
    statistic: Statistic
    test: MeanTest


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout's settings and the tests they imply."""

    settings: RolloutSettings
    tests: tuple[TestSpec, ...]

    @property
    def alpha(self) -> float:
        return self.settings.alpha

    def log_threshold(self, role: Role) -> float:
        """Reject when log(e) reaches this: log(1/alpha), guardrails sharing alpha."""
        share = max(1, len(self.of_role("guardrail"))) if role == "guardrail" else 1
        return math.log(share / self.alpha)

    def of_role(self, role: Role) -> tuple[TestSpec, ...]:
        return tuple(t for t in self.tests if t.role == role)


def build_spec(settings: RolloutSettings) -> RolloutSpec:
    """The tests of `settings`: the target's (and its equivalence pair), then the guardrails."""
    watched = [(f"guardrail_{m}", m, tolerance) for m, tolerance in settings.guardrails.items()]
    target = settings.metric
    if target not in settings.guardrails:
        tolerance = REGRESSION_P99_TOLERANCE if BY_NAME[target].kind == "tail" else 0.0
        watched.append((f"regression_{target}", target, tolerance))
    return RolloutSpec(settings, (*_target_tests(target), *_guardrails(watched)))


def unsampled_notes(spec: RolloutSpec, upstream_arms: list[str]) -> list[str]:
    """What the operator must know of tests fed by TTFT or TPOT when a compared arm is
    upstream: the gateway learns those only from a stream, so unstreamed requests feed them
    nothing (their e2e and errors still count)."""
    tests = [t.name for t in spec.tests if t.field in (TTFT_MS, TPOT_MS)]
    if not upstream_arms or not tests:
        return []
    return [
        f"the tests {', '.join(tests)} get samples only from streamed requests: the upstream "
        f"arm(s) {', '.join(upstream_arms)} report no TTFT or TPOT for an unstreamed reply"
    ]


def _target_tests(name: str) -> tuple[TestSpec, ...]:
    metric = BY_NAME[name]
    field = metric.field
    if metric.kind == "rate":
        return (TestSpec("target", "target", field, "paired", reverse_difference, MeanTest(0, -1)),)
    if metric.kind == "tail":
        null = MeanTest(-(1 - TAIL_QUANTILE), -1.0)
        return (TestSpec("target", "target", field, "tail", within_tail, null),)
    high = MeanTest(-(0.5 + EQUIVALENCE_MARGIN), -1.0)
    low = MeanTest(0.5 - EQUIVALENCE_MARGIN, 0.0)
    return (
        TestSpec("target", "target", field, "paired", below(), MeanTest(0.5, 0.0)),
        TestSpec("equivalent_high", "equivalence", field, "paired", negated_below, high),
        TestSpec("equivalent_low", "equivalence", field, "paired", below(), low),
    )


def _guardrails(watched: list[tuple[str, str, float]]) -> tuple[TestSpec, ...]:
    """(name, metric, tolerance) of each guardrail -> its test."""
    tests = []
    for name, metric_name, tolerance in watched:
        metric = BY_NAME[metric_name]
        field = metric.field
        if metric.kind == "rate":
            test = MeanTest(tolerance, -1.0)
            tests.append(TestSpec(name, "guardrail", field, "paired", difference, test))
            continue
        if metric.kind == "tail":
            test = MeanTest(1 - TAIL_QUANTILE, 0.0)
            statistic = exceeds(1 + tolerance)
            tests.append(TestSpec(name, "guardrail", field, "tail", statistic, test))
        else:
            statistic = above(1 + tolerance)
            tests.append(TestSpec(name, "guardrail", field, "paired", statistic, MeanTest(0.5, 0)))
    return tuple(tests)
