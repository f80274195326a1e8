"""Where torch work runs: set-up on a thread that exits, every forward pass on one thread.

libgomp (torch's OpenMP on Linux) keeps a pool of worker threads for every thread that ever
ran a parallel region, for as long as that thread lives, and once it manages more threads
than there are CPUs it throttles its spin-waits to almost nothing. Loading a model on a
long-lived thread (the caller's main thread, or an `asyncio.to_thread` executor thread)
leaves such a pool next to the engine thread's own, and every op of every decode step then
pays futex wake-ups. Measured on the 2-core machine, B = 32 decode iterations of a served
engine: median 155 ms after loading on an executor thread, 127 ms after loading on a
thread that exited (12 runs each, servers alternated; docs/benchmarks/history/).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

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


_device_lock = threading.Lock()
_device_executor: ThreadPoolExecutor | None = None


def run_on_device_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the process's one long-lived device thread, waiting for the result.

    Every engine in the process (one per local A/B arm) runs its forward passes here, so
    there is one OpenMP pool whatever the number of arms; their steps take turns instead of
    oversubscribing the cores.
    """
    global _device_executor
    with _device_lock:
        if _device_executor is None:
            _device_executor = ThreadPoolExecutor(1, thread_name_prefix="carousel-device")
        executor = _device_executor
    return executor.submit(fn, *args).result()
