"""Whether two arms ran the same iteration schedule: a policy that changes nothing, named.

A schedule's shape is, per engine iteration in order, (sequences in the batch, prefill tokens,
decode tokens), from the iteration trace (bench/trace.py). Timings, ids and wall-clock starts
are left out, so timing noise alone does not tell two schedules apart; arrivals that land on
another side of an iteration boundary do, so a False says the schedules differ, not that the
policies must.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.trace import ArmTrace

Shape = tuple[tuple[int, int, int], ...]


def schedule_shape(trace: ArmTrace) -> Shape | None:
    """The run's schedule shape; None without a whole trace (none fetched, or truncated)."""
    if not trace.available or not trace.starts_in_window:
        return None
    return tuple(
        (
            len(it.get("seq_ids") or it.get("request_ids") or ()),
            int(it.get("num_prefill_tokens", 0)),
            int(it.get("num_decode_tokens", 0)),
        )
        for it in trace.iterations
    )


def same_schedule(base: Sequence[ArmTrace], arm: Sequence[ArmTrace]) -> bool | None:
    """True when every repeat of both arms ran the same shape; None when one cannot tell."""
    if not base or len(base) != len(arm):
        return None
    shapes = [(schedule_shape(b), schedule_shape(a)) for b, a in zip(base, arm, strict=True)]
    if any(b is None or a is None for b, a in shapes):
        return None
    return all(b == a for b, a in shapes)
