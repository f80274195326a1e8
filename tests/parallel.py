"""The suite under pytest-xdist (`make test` runs it on two workers): the cores shared out
between the workers, and the tests marked `serial` given the machine to themselves.

Why: most tests wait on sockets, sleeps and subprocess servers, so two workers finish the
suite sooner even on two cores; but each worker's torch would start one OpenMP thread per
core, and a test that times a window (a drain deadline, arrivals to tens of milliseconds)
measures the other worker's load. So each worker's torch gets its share of the cores, and a
`serial` test waits until the other workers are between tests, holds them off while it runs
and gets every core back. Outside xdist (a plain `pytest`) nothing here does anything.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

#: the controller's folder of lock files, handed to its workers through their environment
LOCK_DIR_ENV = "TESTS_MACHINE_LOCK_DIR"
SERIAL = "serial"
#: fixtures whose tests time windows of under a second: those tests run `serial` unmarked
TIMED_FIXTURES = ("no_gc_pauses",)


def cores() -> int:
    """The cores this process may run on (a container's or taskset's limit included)."""
    return len(os.sched_getaffinity(0))


def worker_count() -> int:
    """How many xdist workers share the machine (1 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def set_threads(threads: int) -> None:
    """Torch's intra-op threads in this process, and in every process it starts from now
    (the `carousel serve` subprocesses read OMP_NUM_THREADS when they import torch)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # not imported yet: it reads OMP_NUM_THREADS when it is
        sys.modules["torch"].set_num_threads(threads)


#: this process's part: "worker" (an xdist worker of this run), "controller" (it made the
#: lock folder), or None. NOTE: a pytest a test starts in a subprocess inherits the workers'
#: environment (PYTEST_XDIST_WORKER, the lock folder) but is neither, so it must neither take
#: the workers' locks nor remove their folder
_role: str | None = None


def configure(config: pytest.Config) -> None:
    """The controller makes the lock folder its workers share; a worker takes its share of
    the cores."""
    global _role
    if is_worker(config):
        _role = "worker"
        set_threads(max(1, cores() // worker_count()))
    elif config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        _role = "controller"
        os.environ[LOCK_DIR_ENV] = tempfile.mkdtemp(prefix="carousel-tests-")


def unconfigure(config: pytest.Config) -> None:
    """The controller removes the lock folder once its workers have gone."""
    global _role
    if _role == "controller" and LOCK_DIR_ENV in os.environ:
        shutil.rmtree(os.environ.pop(LOCK_DIR_ENV), ignore_errors=True)
    _role = None


def claim(name: str) -> bool:
    """Whether this process is the first of the run's workers to claim `name` (a job one of
    them starts for all); outside xdist, always."""
    folder = os.environ.get(LOCK_DIR_ENV)
    if _role != "worker" or not folder:
        return True
    try:
        os.close(os.open(Path(folder) / f"claimed-{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def mark_timed_tests_serial(items: list[pytest.Item]) -> None:
    """Tests that use a timing fixture are `serial` without having to say so."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in TIMED_FIXTURES):
            item.add_marker(SERIAL)


class MachineLock:
    """A readers-writer lock over the workers: every test holds it shared, a `serial` test
    exclusively. Two flocks: `turnstile`, taken by every test on its way in and held by a
    `serial` test while it waits, so a worker going from test to test cannot starve it; and
    `machine`, the lock itself. flocks end with their process, so a worker that dies holds
    nothing."""

    def __init__(self, folder: Path) -> None:
        self.turnstile: IO[str] = (folder / "turnstile").open("a")
        self.machine: IO[str] = (folder / "machine").open("a")

    @contextmanager
    def shared(self) -> Iterator[None]:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.machine, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self.machine, fcntl.LOCK_UN)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.machine, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.machine, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)


_lock: MachineLock | None = None


def machine_lock() -> MachineLock | None:
    """This worker's handle on the controller's lock (None outside xdist)."""
    global _lock
    folder = os.environ.get(LOCK_DIR_ENV)
    if _lock is None and folder and _role == "worker":
        _lock = MachineLock(Path(folder))
    return _lock


@contextmanager
def machine_share(item: pytest.Item) -> Iterator[None]:
    """Run `item` (setup, call and teardown) holding the machine as its marks ask: a
    `serial` test alone and with all the cores, any other beside the other workers."""
    lock = machine_lock()
    if lock is None:
        yield
    elif item.get_closest_marker(SERIAL) is None:
        with lock.shared():
            yield
    else:
        with lock.exclusive():
            set_threads(cores())
            try:
                yield
            finally:
                set_threads(max(1, cores() // worker_count()))
