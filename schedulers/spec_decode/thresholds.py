"""Where verifying drafts pays, from measured decode-step times (scripts/spec_thresholds.py).

A step of B decoding rows that each verify k drafts takes t(B, k); without drafts, t(B, 0).
It emits B * (1 + a) tokens, a being the mean drafts accepted per row, against B tokens, so
drafting pays when t(B, k) / t(B, 0) < 1 + a: the break-even acceptance is
t(B, k) / t(B, 0) - 1. Prompt lookup accepts at most what its drafts match; with a draft
accepted with probability p, given every draft before it was, k drafts yield
p + p^2 + ... + p^k accepted tokens (`expected_accepted`). `max_concurrency` is the most
decoding rows at which some k in 1..max_k still pays at that acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping

#: step times by (rows B, drafts per row k) in seconds; k = 0 is the plain decode step
StepTimes = Mapping[tuple[int, int], float]


def expected_accepted(p: float, k: int) -> float:
    """Mean accepted drafts of k, each accepted with probability `p` once the ones before
    it were (p + p^2 + ... + p^k)."""
    return sum(p**i for i in range(1, k + 1))


def break_even(times: StepTimes) -> dict[tuple[int, int], float]:
    """(B, k) -> the mean accepted drafts per row a step must yield to pay:
    t(B, k) / t(B, 0) - 1, for every k > 0 measured beside its B's k = 0."""
    out: dict[tuple[int, int], float] = {}
    for (rows, k), seconds in times.items():
        base = times.get((rows, 0))
        if k > 0 and base:
            out[rows, k] = seconds / base - 1.0
    return out


def best_k(times: StepTimes, rows: int, p: float, only_k: int | None = None) -> tuple[int, float]:
    """(k, margin) at `rows`: the draft length with the largest expected gain
    1 + accepted(p, k) - t(B, k) / t(B, 0) (among k = `only_k` alone when given); (0, 0.0)
    when no such k gains."""
    best, margin = 0, 0.0
    for (b, k), needed in sorted(break_even(times).items()):
        if b != rows or only_k not in (None, k):
            continue
        gain = expected_accepted(p, k) - needed
        if gain > margin:
            best, margin = k, gain
    return best, margin


def max_concurrency(times: StepTimes, p: float, only_k: int | None = None) -> int | None:
    """The most decoding rows measured at which drafting still pays at acceptance `p` (some
    k gains, `best_k`; with `only_k`, that draft length), every smaller row count measured
    paying too; None when it pays at every measured row count, 0 when it pays at none.

    The load switch needs `only_k` = the configured k: below it the adaptive ladder picks a
    sequence's k from its acceptance alone, not from the step's cost, so a sequence that
    accepts well drafts the full k at any load the switch lets through."""
    rows = sorted({b for b, k in times if k == 0})
    paying = 0
    for b in rows:
        if best_k(times, b, p, only_k)[0] == 0:
            return paying
        paying = b
    return None
