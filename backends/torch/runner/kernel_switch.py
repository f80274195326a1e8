"""Serve at once on torch's ops, take Carousel's CPU kernels between two steps once built.

A first start on a fresh machine would otherwise wait for the kernels' g++ build (one
compiler job, about 2 minutes) before the first token (issue 52). A backend whose kernels are
not built yet builds its model without them (`cpu_kernels=False`: torch's maintained ops,
attention `auto` being `sdpa`) and serves; this thread, at the lowest priority (nice 19: on
Linux nice is per thread and the compiler processes it forks inherit it), builds the kernels,
then the kernels'
`PagedCausalLM` over the same HF model and the same KV cache (one layout for every attention
backend, attention/base.py), and hands it to the device thread, which swaps it in between two
steps (device_thread.py runs one job at a time). A request in flight goes on with its KV
intact; the sampler stays as built (torch's argmax). A failed build keeps torch's ops, logged.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

from backends.torch import kernels
from backends.torch.layers.linear import NATIVE
from backends.torch.logs import engine_log
from backends.torch.runner.device_thread import run_on_device_thread
from backends.torch.runner.model_impl import PagedModel
from schedulers.load_phase import KERNELS_BUILDING, KERNELS_CAROUSEL, KERNELS_TORCH

log = engine_log()

#: the nice value of the background build: the lowest priority, below any serving thread
LOWEST_PRIORITY = 19


def serves_kernels(model: PagedModel) -> bool:
    """Whether a built model (either path: runner/model_impl.py) runs any of Carousel's CPU
    kernels (its norms and MLP, its packed linears, or its attention's decodes)."""
    plan = model.plan
    return (
        model.dense_kernels is not None
        or (plan is not None and plan.kernel == NATIVE)
        or bool(model.attention.native_decodes)
    )


def lowest_priority() -> None:
    """Renice the calling thread (Linux: nice is per thread; children inherit it)."""
    if sys.platform != "linux":
        return  # NOTE: elsewhere PRIO_PROCESS with a thread id would renice another process
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except OSError as exc:
        log.warning("cpu_kernels_background_renice_failed", error=str(exc))


def build_kernels() -> ModuleType | None:
    """The CPU kernels, built now if they must be, as a background build (not a load phase:
    `/health` stays ready). The switch's one call of the build: tests put a gate here."""
    return kernels.native(background=True)


class KernelSwitch:
    """The background build and the one swap to the kernels' model (see the module docstring).

    `build_model` builds the model over the kernels once `build_kernels` has them; `install`
    swaps it in, called on the device thread.
    """

    def __init__(
        self, build_model: Callable[[], PagedModel], install: Callable[[PagedModel], None]
    ) -> None:
        self._build_model = build_model
        self._install = install
        self._state = KERNELS_BUILDING
        self._closed = threading.Event()
        self._ready_at = time.monotonic()
        #: why torch's ops still serve after the build (None while building or once switched)
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="carousel-kernels", daemon=True)

    @property
    def state(self) -> str:
        """`building`, then `carousel` once swapped in (or `torch` where the build failed)."""
        return self._state

    def start(self) -> None:
        """Start the build; the backend serves on torch's ops meanwhile."""
        self._ready_at = time.monotonic()
        log.info("cpu_kernels_background", serving=KERNELS_TORCH, nice=LOWEST_PRIORITY)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the build and the swap (tests); whether they are over."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """The backend is closing: a model built after this is dropped, never swapped in."""
        self._closed.set()

    def _run(self) -> None:
        lowest_priority()
        try:
            if build_kernels() is None:
                self._fail(kernels.why_off())
                return
            if self._closed.is_set():
                return
            model = self._build_model()
        except Exception as exc:  # noqa: BLE001 - a failed build keeps torch's ops serving
            self._fail(f"{type(exc).__name__}: {exc}"[-2000:])
            return
        if not self._closed.is_set():
            run_on_device_thread(self._swap, model)

    def _swap(self, model: PagedModel) -> None:
        """On the device thread, between two steps: the kernels' model serves from now on."""
        if self._closed.is_set():
            return
        self._install(model)
        self._state = KERNELS_CAROUSEL
        seconds = round(time.monotonic() - self._ready_at, 1)
        log.info("cpu_kernels_serving", seconds_since_load=seconds)

    def _fail(self, why: str) -> None:
        self.failure = why
        self._state = KERNELS_TORCH
        log.warning("cpu_kernels_background_failed", serving=KERNELS_TORCH, why=why)
