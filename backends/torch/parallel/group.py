"""The tensor-parallel process group, as rank 0 (the engine's process) runs it.

`acquire_group(n, device_type)` joins this process to a torch.distributed group of `n` ranks:
`nccl` on CUDA (one GPU per rank) with a `gloo` side group for control messages, `gloo` alone
on CPU. This process is rank 0. The other ranks are either spawned here with torch's own
multiprocessing (one node), or started elsewhere from the torchrun-style environment
(`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; see docs/parallelism.md),
which is how several nodes join. Each non-zero rank runs worker.py's loop.

Rank 0 talks to the others over the control group (channel.py; rendezvous.py forms the
group). A HEARTBEAT (an all-reduce of one number) goes out whenever rank 0 has been quiet
for `heartbeat_s` (1 s, or a quarter of the timeout when that is shorter), so a worker
never waits longer than that for a header while rank 0 lives, and rank 0 hears of a hung
worker within `timeout_s` even with no traffic.

Faults: a spawned rank that exits is seen at once (process sentinels); a collective that
fails or times out (`timeout_s`) is fatal too. Either way the group is dead for good:
`dead_reason` says which rank and why, listeners (the engine) hear it, the spawned ranks
are ended, and every later exchange raises `BackendDeadError`.

NOTE: torch.distributed has one default group per process, so a process runs at most one
tensor-parallel group; every tensor-parallel arm of one process shares it (and its size).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backends.torch.parallel.channel import Channel, Kind
from backends.torch.parallel.rendezvous import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    control_group,
    environment_store,
    from_environment,
    join_group,
    local_device,
)
from backends.torch.parallel.worker import TensorParallelWorker, run_spawned
from schedulers.backend import BackendDeadError

DEFAULT_HEARTBEAT_S = 1.0


class TensorParallelGroup:
    """Rank 0's handle on the group: control messages, liveness, shutdown (module docstring)."""

    def __init__(
        self,
        world_size: int,
        device_type: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_s: float | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        self.world_size = world_size
        self.device_type = device_type
        self.timeout_s = timeout_s
        # NOTE: well inside the timeout, or an idle worker's wait for a header times out
        self.heartbeat_s = heartbeat_s or min(DEFAULT_HEARTBEAT_S, timeout_s / 4)
        self.start_timeout_s = start_timeout_s
        self.dead_reason: str | None = None
        self.processes: list[Any] = []  # spawned ranks 1..n-1 (empty when started elsewhere)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self._closed = threading.Event()
        self._last_exchange = time.monotonic()
        self._instances = iter(range(1, 1 << 62))
        self._threads: list[threading.Thread] = []
        self._store: Any = None  # NOTE: rank 0 may serve the store: keep it for the group's life
        self.device = self._start()
        self.channel = Channel(
            control_group(device_type, self._timeout), self._store, start_timeout_s,
            failed=self._exited_reason,
        )  # fmt: skip
        self.channel.meet("serving")  # every worker is in its loop, reading headers
        self.worker = TensorParallelWorker(self.channel, self.device)  # rank 0's
        self.refs = 0
        for target in (self._monitor, self._heartbeats):
            thread = threading.Thread(target=target, name="carousel-tp-" + target.__name__[1:])
            thread.daemon = True
            thread.start()
            self._threads.append(thread)

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _start(self) -> torch.device:
        if from_environment():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != self.world_size or rank != 0:
                raise ValueError(
                    f"tensor_parallel_size {self.world_size} on RANK {rank} of WORLD_SIZE "
                    f"{world}: the serving process must be rank 0 of a group of that size"
                )
            device = local_device(self.device_type, int(os.environ.get("LOCAL_RANK", "0")))
            store = self._store = environment_store(self.start_timeout_s)
            join_group(store, 0, world, self.device_type, self.timeout_s, self.start_timeout_s)
            return device
        device = local_device(self.device_type, 0)
        store = self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.start_timeout_s),
        )  # fmt: skip
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        args = (self.world_size, store.port, self.device_type, os.getpid(), self.timeout_s,
                self.start_timeout_s, threads)  # fmt: skip
        # NOTE: plain Processes of torch's spawn context, not `mp.start_processes`: that sets
        # PR_SET_PDEATHSIG, which fires when the spawning *thread* exits (the load thread does)
        context = mp.get_context("spawn")
        self.processes = [
            context.Process(target=run_spawned, args=(rank, *args), daemon=True)
            for rank in range(1, self.world_size)
        ]
        for proc in self.processes:
            proc.start()
        try:
            join_group(
                store, 0, self.world_size, self.device_type, self.timeout_s,
                self.start_timeout_s, failed=self._exited_reason,
            )  # fmt: skip
        except BaseException:
            self._end_processes(grace_s=0.0)
            raise
        return device

    # -- exchanges (rank 0) ----------------------------------------------------------

    def new_instance_id(self) -> int:
        return next(self._instances)

    @contextlib.contextmanager
    def exchange(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the group for one exchange (yields False when busy and not `blocking`).

        Any failure inside is fatal: the ranks may be mid-collective, out of step for good.
        """
        if not self._lock.acquire(blocking=blocking):
            yield False
            return
        try:
            if self.dead_reason is not None:
                raise BackendDeadError(self.dead_reason)
            try:
                yield True
            except Exception as exc:
                self._die(self._exited_reason(wait_s=0.5) or f"tensor-parallel group failed: {exc}")
                raise BackendDeadError(self.dead_reason or str(exc)) from exc
        finally:
            self._last_exchange = time.monotonic()
            self._lock.release()

    def call(self, kind: Kind, instance: int = 0, *args: Any) -> Any:
        """`kind` on every rank's worker, rank 0's result (holds the group for the exchange)."""
        with self.exchange():
            return self.worker.call(kind, instance, *args)

    # -- liveness --------------------------------------------------------------------

    def add_listener(self, on_dead: Callable[[str], None]) -> None:
        """Call `on_dead(reason)` (from any thread) when the group dies; now if it has."""
        self._listeners.append(on_dead)
        if self.dead_reason is not None:
            on_dead(self.dead_reason)

    def remove_listener(self, on_dead: Callable[[str], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(on_dead)

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None or self._closed.is_set():
            return
        self.dead_reason = reason
        for listener in list(self._listeners):
            listener(reason)
        self._end_processes(grace_s=0.0)  # the survivors wait on a dead group: end them

    def _exited_reason(self, wait_s: float = 0.0) -> str | None:
        """Which spawned rank has exited, and how (waiting up to `wait_s` for one to)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.processes, start=1):
                if proc.exitcode is not None:
                    return (
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited "
                        f"with code {proc.exitcode}"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _monitor(self) -> None:
        sentinels = [p.sentinel for p in self.processes]
        while sentinels and not self._closed.is_set():
            if multiprocessing.connection.wait(sentinels, timeout=0.5):
                if not self._closed.is_set():
                    self._die(self._exited_reason(wait_s=0.5) or "a tensor-parallel rank exited")
                return

    def _heartbeats(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 2):
            if self.dead_reason is not None:
                return
            if time.monotonic() - self._last_exchange < self.heartbeat_s:
                continue
            with contextlib.suppress(BackendDeadError), self.exchange(blocking=False) as held:
                if held:
                    self.worker.call(Kind.HEARTBEAT)

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank and leave the group; nothing of it is left running afterwards."""
        if self._closed.is_set():
            return
        self._closed.set()  # NOTE: first, so the ranks' exits below are not taken for a fault
        if self.dead_reason is None:
            with contextlib.suppress(BackendDeadError):
                self.call(Kind.SHUTDOWN)
        self._end_processes(grace_s=5.0)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2.0)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _end_processes(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            proc.join(0.5)
            if proc.is_alive():  # NOTE: a stopped (hung) process ignores SIGTERM until resumed
                proc.kill()
                proc.join(1.0)


_current: TensorParallelGroup | None = None
_current_lock = threading.Lock()


def acquire_group(
    world_size: int, device_type: str, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TensorParallelGroup:
    """This process's group of `world_size` ranks, started on first use (see NOTE above)."""
    global _current
    with _current_lock:
        group = _current
        if group is not None and group.refs == 0:
            group = _current = None
        if group is None:
            group = _current = TensorParallelGroup(world_size, device_type, timeout_s=timeout_s)
        elif group.world_size != world_size or group.device_type != device_type:
            raise ValueError(
                f"this process already runs a tensor-parallel group of {group.world_size} "
                f"{group.device_type} ranks; every tensor-parallel arm of one process uses it "
                "(serve an arm of another size from its own `carousel serve`)"
            )
        elif group.dead_reason is not None:
            raise RuntimeError(f"this process's tensor-parallel group is dead: {group.dead_reason}")
        group.refs += 1
        return group


def release_group(group: TensorParallelGroup) -> None:
    """Drop one reference; the last one closes the group."""
    global _current
    with _current_lock:
        group.refs -= 1
        if group.refs > 0:
            return
        if _current is group:
            _current = None
    group.close()
