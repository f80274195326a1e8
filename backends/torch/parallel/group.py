"""The tensor-parallel process group, as rank 0 (the engine's process) runs it.

`acquire_group(n, device_type)` joins this process to a torch.distributed group of `n` ranks:
`nccl` on CUDA (one GPU per rank) with a `gloo` side group for control messages, `gloo` alone
on CPU. This process is rank 0. The other ranks are either spawned here with torch's own
multiprocessing (one node), or started elsewhere from the torchrun-style environment
(`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; see docs/parallelism.md),
which is how several nodes join. Each non-zero rank runs worker.py's loop.

Control protocol (rank 0 -> all, over the control group): a fixed header `[kind, instance,
N, B, W, R]` (step.py), then a kind-specific body: a STEP's flat int64 buffer, a LOAD's
pickled spec. A HEARTBEAT (an all-reduce of one number) goes out whenever rank 0 has been
quiet for `heartbeat_s`, so a worker never waits longer than that for a header while rank 0
lives, and rank 0 hears of a hung worker within `timeout_s` even with no traffic.

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
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backends.torch.parallel.step import HEADER_LEN
from schedulers.backend import BackendDeadError

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_S = 1.0
_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


class Kind(IntEnum):
    """What a control header announces."""

    STEP = 1
    HEARTBEAT = 2
    LOAD = 3
    UNLOAD = 4
    SHUTDOWN = 5
    DESCRIBE = 6


def dist_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def from_environment() -> bool:
    """Whether the torchrun-style variables describe a group of more than one rank."""
    return all(os.environ.get(k) for k in _ENV) and int(os.environ["WORLD_SIZE"]) > 1


def local_device(device_type: str, local_rank: int) -> torch.device:
    """A rank's device: `cuda:LOCAL_RANK` on CUDA (set as the current device), else cpu."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def control_group(device_type: str, timeout: datetime.timedelta) -> Any:
    """The group control messages travel on: the world on CPU, a gloo side group on CUDA."""
    return dist.new_group(backend="gloo", timeout=timeout) if device_type == "cuda" else None


def environment_store(start_timeout_s: float) -> Any:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT (torchrun's own when it runs us)."""
    rank = int(os.environ["RANK"])
    # NOTE: under torchrun its agent already serves a store on MASTER_PORT; we join it
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=rank == 0 and not use_agent_store, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=start_timeout_s),
    )  # fmt: skip


def join_group(
    store: Any,
    rank: int,
    world_size: int,
    device_type: str,
    timeout_s: float,
    start_timeout_s: float,
    failed: Callable[[], str | None] | None = None,
) -> None:
    """Wait (up to `start_timeout_s`) until every rank is up, then init the process group.

    NOTE: the group's own timeout (`timeout_s`) bounds every later collective, so ranks
    that take long to start (importing torch, on a busy machine) first meet in the store.
    """
    if device_type == "cuda":
        # NOTE: on a timed-out or failed NCCL collective, abort the communicator and raise (2)
        # rather than kill the process (torch's default): the server may hold other arms
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    prefix = f"carousel/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/ready/{rank}", device_type)
    keys = [f"{prefix}/ready/{r}" for r in range(world_size)]
    deadline = time.monotonic() + start_timeout_s
    while not store.check(keys):
        reason = failed() if failed is not None else None
        if reason is not None:
            raise RuntimeError(f"a tensor-parallel rank failed to start: {reason}")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise TimeoutError(
                f"tensor-parallel ranks {', '.join(missing)} did not join within "
                f"{start_timeout_s:.0f} s"
            )
        time.sleep(0.05)
    devices = [store.get(k).decode() for k in keys]
    if len(set(devices)) > 1:
        raise ValueError(f"the ranks disagree on the device type: {devices} (rank order)")
    dist.init_process_group(
        dist_backend(device_type),
        store=dist.PrefixStore(f"{prefix}/group", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class Channel:
    """Rank 0's and the workers' side of the control protocol (same calls, same order)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def header(self, values: list[int] | None = None) -> list[int]:
        """Rank 0 sends `values`; every other rank receives them."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        if values is not None:
            header[: len(values)] = torch.tensor(values)
        dist.broadcast(header, group_src=0, group=self.group)
        return [int(v) for v in header.tolist()]

    def buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """Rank 0's int64 `buffer` on every rank (the others pass one of the right length)."""
        dist.broadcast(buffer, group_src=0, group=self.group)
        return buffer

    def object(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def heartbeat(self) -> None:
        dist.all_reduce(torch.ones(1), group=self.group)


class TensorParallelGroup:
    """Rank 0's handle on the group: control messages, liveness, shutdown (module docstring)."""

    def __init__(
        self,
        world_size: int,
        device_type: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        self.world_size = world_size
        self.device_type = device_type
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
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
        self.channel = Channel(control_group(device_type, self._timeout))
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
        from backends.torch.parallel.worker import run_spawned

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

    def send(self, kind: Kind, instance: int = 0, sizes: list[int] | None = None) -> None:
        """Announce `kind` to every rank (call inside `exchange`)."""
        self.channel.header([int(kind), instance, *(sizes or [])])

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
                    self.send(Kind.HEARTBEAT)
                    self.channel.heartbeat()

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank and leave the group; nothing of it is left running afterwards."""
        if self._closed.is_set():
            return
        self._closed.set()  # NOTE: first, so the ranks' exits below are not taken for a fault
        if self.dead_reason is None:
            with contextlib.suppress(BackendDeadError), self.exchange():
                self.send(Kind.SHUTDOWN)
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
