"""Which arm serves a request: the `X-Carousel-Arm` header, else sticky by `user`, else weights.

A request naming an arm in the header gets that arm (an unknown name is a 400; an arm that
cannot serve now is a 503). Otherwise the choice is a point in [0, 1) laid over the arms'
cumulative weights: a stable hash of `user` when the request has one, so a user always lands
on the same arm, else a fresh random draw. Arms that cannot serve now are left out of the
draw, so a dead arm's share goes to the others rather than failing requests.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

ARM_HEADER = "X-Carousel-Arm"


class Weighted(Protocol):
    name: str
    weight: float


T = TypeVar("T", bound=Weighted)


def user_point(user: str) -> float:
    """A stable point in [0, 1) for `user` (the same on every process and restart)."""
    digest = hashlib.sha256(user.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose_by_weight(arms: Sequence[T], point: float) -> T | None:
    """The arm whose slice of the cumulative weights holds `point`; None if no weight."""
    total = sum(a.weight for a in arms)
    if total <= 0:
        return None
    target = point * total
    running = 0.0
    for arm in arms:
        running += arm.weight
        if target < running and arm.weight > 0:
            return arm
    return next(a for a in reversed(arms) if a.weight > 0)


def draw_point(user: str | None) -> float:
    return user_point(user) if user else random.random()
