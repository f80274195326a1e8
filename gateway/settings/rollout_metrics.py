"""The rollout's metrics, each written once: its name in `rollout:`, the per-request sample
field its tests read, its kind and which way is better.

The `rollout:` block's valid `metric` and guardrail names (gateway/settings/rollout.py), the
tests each one implies (gateway/rollout/spec.py), the sample fields a finished request gives
(gateway/rollout/evidence.py) and the table in docs/rollout.md (`docs_table`, checked by
tests/test_rollout_metrics.py) all follow from `METRICS`; nothing parses a metric's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: `median`: a paired sign test of the p50; `tail`: the share of candidate requests beyond the
#: reference's running p99; `rate`: the paired difference of a 0/1 field's shares
Kind = Literal["median", "tail", "rate"]
#: which way of the metric is better for the candidate
Direction = Literal["lower", "higher"]

#: the sample fields of a finished request (NaN or absent: not measured, e.g. a failure)
TTFT_MS, TPOT_MS, E2E_MS, ERROR = "ttft_ms", "tpot_ms", "e2e_ms", "error"


@dataclass(frozen=True)
class RolloutMetric:
    """One metric a rollout may target (`metric:`, what must improve) or guard."""

    name: str
    #: the sample field its tests read
    field: str
    kind: Kind
    direction: Direction
    #: may be the rollout's `metric` (the target)
    target: bool
    #: may be a guardrail
    guardrail: bool
    #: what it is, for the docs
    description: str


METRICS: tuple[RolloutMetric, ...] = (
    RolloutMetric("ttft_p50", TTFT_MS, "median", "lower", True, True, "median time to first token"),
    RolloutMetric("ttft_p99", TTFT_MS, "tail", "lower", True, True, "p99 time to first token"),
    RolloutMetric("tpot_p50", TPOT_MS, "median", "lower", True, True, "median time per token"),
    RolloutMetric("tpot_p99", TPOT_MS, "tail", "lower", False, True, "p99 time per token"),
    RolloutMetric("e2e_p50", E2E_MS, "median", "lower", True, True, "median request latency"),
    RolloutMetric("e2e_p99", E2E_MS, "tail", "lower", False, True, "p99 request latency"),
    RolloutMetric(
        "error_rate", ERROR, "rate", "lower", True, True,
        "share of requests the arm failed (a client's own mistakes excluded)",
    ),
)  # fmt: skip

BY_NAME = {metric.name: metric for metric in METRICS}
TARGET_METRICS = tuple(m.name for m in METRICS if m.target)
GUARDRAIL_METRICS = tuple(m.name for m in METRICS if m.guardrail)
#: every field a metric reads, in the table's order
SAMPLE_FIELDS = tuple(dict.fromkeys(m.field for m in METRICS))
#: earlier names still accepted in `rollout:` -> the metric they now name (docs/rollout.md):
#: the rollout's `goodput` was the share of requests served without error, which is the
#: error rate read the other way; `goodput` now means only what `carousel bench` reports
RENAMED = {"goodput": "error_rate"}


def current_name(name: str) -> str:
    """`name`, or the metric an earlier name of it now is."""
    return RENAMED.get(name, name)


def docs_table() -> str:
    """The metrics as docs/rollout.md lists them (a Markdown table)."""
    rows = [
        "| metric | reads | kind | better | target | guardrail | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        target, guardrail = ("yes" if m.target else "no"), ("yes" if m.guardrail else "no")
        cells = (f"`{m.name}`", f"`{m.field}`", m.kind, m.direction, target, guardrail)
        rows.append(f"| {' | '.join(cells)} | {m.description} |")
    return "\n".join(rows)
