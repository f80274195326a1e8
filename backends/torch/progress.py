"""A slow phase of loading, logged while it runs: its start, a line every `every_s` seconds
with the time so far (and what `progress` can count), and its end with how long it took.

A first start converts the default model and builds the CPU kernels (about 2 minutes)
and once said nothing meanwhile; these lines, and the phase `/health` names
(schedulers/load_phase.py), say what the wait is for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from backends.torch.logs import engine_log
from schedulers.load_phase import LoadPhase, load_phase

log = engine_log()

#: how often a phase under way logs its progress
PROGRESS_EVERY_S = 15.0


@contextmanager
def reported_phase(
    name: str,
    description: str,
    event: str,
    *,
    every_s: float = PROGRESS_EVERY_S,
    progress: Callable[[], dict[str, Any]] | None = None,
    background: bool = False,
    **fields: Any,
) -> Iterator[LoadPhase]:
    """Run the block as load phase `name`, logging `event` now, `<event>_progress` every
    `every_s` seconds, and `<event>_done` at its end (the seconds it took).

    `background`: the work runs while the server serves (the CPU kernels' build behind a
    backend on torch's ops): logged the same, but not a load phase, so `/health` stays 200.
    """
    where = {"background": True} if background else {}
    log.info(event, phase=name, what=description, **where, **fields)
    stop = threading.Event()
    marked = _unmarked(name, description) if background else load_phase(name, description)
    with marked as phase:
        beat = threading.Thread(
            target=_heartbeat,
            args=(stop, event, phase, every_s, progress),
            name="carousel-progress",
            daemon=True,
        )
        beat.start()
        try:
            yield phase
        finally:
            stop.set()
            beat.join()
    log.info(f"{event}_done", phase=name, seconds=round(phase.elapsed_s, 1))


@contextmanager
def _unmarked(name: str, description: str) -> Iterator[LoadPhase]:
    """A phase timed and logged like a load phase, but not one `/health` reports."""
    yield LoadPhase(name, description)


def _heartbeat(
    stop: threading.Event,
    event: str,
    phase: LoadPhase,
    every_s: float,
    progress: Callable[[], dict[str, Any]] | None,
) -> None:
    while not stop.wait(every_s):
        counted = _counted(progress)
        log.info(f"{event}_progress", phase=phase.name, elapsed_s=round(phase.elapsed_s), **counted)


def _counted(progress: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """What `progress` counts, or nothing where it cannot (a progress line never fails)."""
    if progress is None:
        return {}
    try:
        return progress()
    except OSError:
        return {}
