"""What the process is doing while a backend loads, for `/health` and the logs.

A first start converts the default GGUF model and builds the CPU kernels: minutes of work
that used to leave `/health` answering a bare 503. The loading code names each phase with
`load_phase(...)` (backends/torch: converting the model, building the CPU kernels, loading
the weights, warming up); the gateway shows the innermost one (`current_load_phase`) in its
503 bodies. Process-wide, not per arm: a kernel build or a conversion holds up every arm of
the process alike, and arms load one after another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: phase names (the `phase` of a `/health` 503), in the order a first start meets them
LOADING_MODEL = "loading_model"
CONVERTING_MODEL = "converting_model"
BUILDING_KERNELS = "building_kernels"
WAITING_FOR_KERNELS = "waiting_for_kernels"
WARMING_UP = "warming_up"
#: not a phase of a load: the `X-Carousel-Load-Phase` of a server that serves (on torch's
#: ops) while Carousel's CPU kernels build in the background (backends/torch/runner/
#: kernel_switch.py); `/health` answers 200 meanwhile
BUILDING_KERNELS_IN_BACKGROUND = "building_kernels_in_background"

#: which ops serve a local arm's CPU forward (`Backend.kernels`; `/health`, `/metrics`):
#: torch's maintained ops (the kernels off, unable to run here, or their build failed) ...
KERNELS_TORCH = "torch"
#: ... torch's ops while Carousel's kernels build in the background, to take over between two
#: steps: a measurement must not span it (bench, `ab report` and a rollout wait or refuse)
KERNELS_BUILDING = "building"
#: ... Carousel's own CPU kernels (backends/torch/cpu_kernels)
KERNELS_CAROUSEL = "carousel"


@dataclass(frozen=True)
class LoadPhase:
    """One phase of a load: its name, what it is in words, and when it began."""

    name: str
    description: str
    since: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.since


_lock = threading.Lock()
_active: list[LoadPhase] = []


@contextmanager
def load_phase(name: str, description: str) -> Iterator[LoadPhase]:
    """Mark the block as phase `name` of a load (phases nest; the innermost is current)."""
    phase = LoadPhase(name, description)
    with _lock:
        _active.append(phase)
    try:
        yield phase
    finally:
        with _lock:
            _active.remove(phase)


def current_load_phase() -> LoadPhase | None:
    """The innermost phase under way now, None when nothing is loading."""
    with _lock:
        return _active[-1] if _active else None
