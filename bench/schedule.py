"""Whether two arms ran the same iteration schedule: a policy that changes nothing, named.

A schedule's shape is, per engine iteration in order, (sequences in the batch, prefill tokens,
decode tokens), from the iteration trace (bench/trace.py). Timings, ids and wall-clock starts
are left out. Arrivals that land on another side of an iteration boundary still shift a few
iterations (a burst's first requests join one step earlier or later), so two shapes count as
the same when they match in order except for a small share: their similarity (difflib's
matching ratio, 1.0 identical) is at least `SAME_SCHEDULE_SIMILARITY`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from bench.trace import ArmTrace

Shape = tuple[tuple[int, int, int], ...]
#: shapes this alike are one schedule up to timing noise
SAME_SCHEDULE_SIMILARITY = 0.9


def schedule_shape(trace: ArmTrace) -> Shape | None:
    """The run's schedule shape; None without a whole trace (none fetched, or truncated)."""
    if not trace.available or trace.truncated:
        return None
    return tuple(
        (
            len(it.get("seq_ids") or it.get("request_ids") or ()),
            int(it.get("num_prefill_tokens", 0)),
            int(it.get("num_decode_tokens", 0)),
        )
        for it in trace.iterations
    )


def similarity(a: Shape, b: Shape) -> float:
    """The share of iterations the two shapes have in common, in order (1.0: identical)."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def schedule_similarity(base: Sequence[ArmTrace], arm: Sequence[ArmTrace]) -> float | None:
    """The lowest similarity over the paired repeats; None when a trace is missing."""
    if not base or len(base) != len(arm):
        return None
    shapes = [(schedule_shape(b), schedule_shape(a)) for b, a in zip(base, arm, strict=True)]
    pairs = [(b, a) for b, a in shapes if b is not None and a is not None]
    if len(pairs) != len(shapes):
        return None
    return min(similarity(b, a) for b, a in pairs)


def same_schedule(base: Sequence[ArmTrace], arm: Sequence[ArmTrace]) -> bool | None:
    """True when every repeat of both arms ran the same shape up to timing noise."""
    score = schedule_similarity(base, arm)
    return None if score is None else score >= SAME_SCHEDULE_SIMILARITY
