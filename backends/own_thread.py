"""Run torch set-up work on a thread of its own that exits when the work is done.

libgomp (torch's OpenMP on Linux) keeps a pool of worker threads for every thread that ever
ran a parallel region, for as long as that thread lives, and once it manages more threads
than there are CPUs it throttles its spin-waits to almost nothing. Loading a model on a
long-lived thread (the caller's main thread, or an `asyncio.to_thread` executor thread)
leaves such a pool next to the engine thread's own, and every op of every decode step then
pays futex wake-ups. Measured on the 2-core machine: the served B = 32 decode iteration took
145-155 ms after loading on an executor thread and 123-131 ms after loading on a thread that
exited (median iteration over three runs each, alternating servers, see docs/benchmarks.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_on_own_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` run on a fresh thread named `name`, joined before returning; errors re-raised."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
