"""The decision at a look: a pure function of the step's e-values and counts.

At each look (after every request, or every few seconds: the tests are anytime-valid, so
looking more often costs no error rate):
1. any guardrail's e-value (its carried product from earlier steps times this step's) reaches
   k/alpha (k guardrails) -> **rollback**;
2. else, once each arm has `min_requests` in the step: the target's e-value reaches 1/alpha
   -> **advance**; both equivalence e-values reach 1/alpha -> `on_no_difference` (**hold** or
   **promote**);
3. else, past `max_step_s` -> **hold** (the step stops advancing by itself; the guardrails
   keep watching); else nothing.

`first_decision` applies the same rule to whole arrays of looks at once (the simulator);
`decide` is the one-look case the gateway's controller calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from gateway.rollout.spec import RolloutSpec

Kind = Literal["rollback", "advance", "promote", "hold"]


@dataclass(frozen=True)
class Decision:
    """What to do, why (the test that decided) and the look it was made at."""

    kind: Kind
    reason: str
    index: int = 0


def first_decision(
    spec: RolloutSpec,
    n_baseline: np.ndarray,
    n_candidate: np.ndarray,
    log_e: dict[str, np.ndarray],
    step_age_s: np.ndarray | None = None,
    carried: dict[str, float] | None = None,
) -> Decision | None:
    """The first look (index into the (T,) arrays) at which the rule decides; None if none.

    `log_e`: per test, its log e-value in this step at each look (absent: 0, no evidence yet);
    `carried`: each guardrail's log e-value carried from earlier steps."""
    looks = len(n_baseline)
    carried = carried or {}
    first: list[tuple[int, int, Kind, str]] = []  # (look, priority, kind, reason)

    def earliest(mask: np.ndarray) -> int | None:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else None

    def log_e_of(name: str) -> np.ndarray:
        return np.broadcast_to(np.asarray(log_e.get(name, 0.0), dtype=float), (looks,))

    for test in spec.of_role("guardrail"):
        total = log_e_of(test.name) + carried.get(test.name, 0.0)
        hit = earliest(total >= spec.log_threshold("guardrail"))
        if hit is not None:
            first.append((hit, 0, "rollback", test.name))
    ready = (np.asarray(n_baseline) >= spec.settings.min_requests) & (
        np.asarray(n_candidate) >= spec.settings.min_requests
    )
    for test in spec.of_role("target"):
        hit = earliest(ready & (log_e_of(test.name) >= spec.log_threshold("target")))
        if hit is not None:
            first.append((hit, 1, "advance", test.name))
    equivalence = spec.of_role("equivalence")
    if equivalence:
        level = spec.log_threshold("equivalence")
        both = np.logical_and.reduce([log_e_of(t.name) >= level for t in equivalence])
        hit = earliest(ready & both)
        if hit is not None:
            first.append((hit, 2, spec.settings.on_no_difference, "no_difference"))
    if step_age_s is not None:
        hit = earliest(np.asarray(step_age_s) >= spec.settings.max_step_s)
        if hit is not None:
            first.append((hit, 3, "hold", "max_step_s"))
    if not first:
        return None
    look, _, kind, reason = min(first)
    return Decision(kind, reason, look)


def decide(
    spec: RolloutSpec,
    n_baseline: int,
    n_candidate: int,
    log_e: dict[str, float],
    step_age_s: float,
    carried: dict[str, float] | None = None,
) -> Decision | None:
    """The decision at one look (see the module docstring); None: keep going."""
    arrays = {name: np.asarray([value]) for name, value in log_e.items()}
    return first_decision(
        spec,
        np.asarray([n_baseline]),
        np.asarray([n_candidate]),
        arrays,
        np.asarray([step_age_s]),
        carried,
    )
