"""`TensorParallelWorker`: the one worker class of every rank of the tensor-parallel group.

Rank 0 (the engine's process, group.py) `call`s its worker: the call goes to every other
rank as a control message, then runs on rank 0 too; every other rank joins the group and
runs its worker's `loop`, which receives each message and makes the same call. Started
either by rank 0 with torch's multiprocessing (`run_spawned`, one node), or on any node
from the torchrun-style environment::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 LOCAL_RANK=0 \
        python -m backends.torch.parallel.worker [--device cuda] [--timeout-s 30]

A worker holds one model instance (rank.py) per tensor-parallel arm of rank 0 (LOAD /
UNLOAD) and runs each STEP's forward on its shard. A worker's loop exits on SHUTDOWN; on any
failure of a collective (rank 0 gone, or silent past the timeout: rank 0 sends a heartbeat
every second while idle); and, when spawned, as soon as its parent process is gone (checked
twice a second), so a killed server leaves no worker behind. Started from the environment
it ignores SIGTERM and SIGINT: the server drains on them, and the drain needs every rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from backends.torch.parallel.channel import Channel, Kind
from backends.torch.parallel.rank import LoadSpec, RankBackend
from backends.torch.parallel.rendezvous import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    control_group,
    environment_store,
    join_group,
    local_device,
)
from backends.torch.parallel.step import FlatStep


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """End this process (from a daemon thread) once `parent_pid` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="carousel-tp-parent", daemon=True).start()


def run_spawned(
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    parent_pid: int,
    timeout_s: float,
    start_timeout_s: float,
    threads: int,
) -> None:
    """Entry point of rank `rank`, spawned by rank 0 (group.py)."""
    exit_with_parent(parent_pid)
    if device_type == "cpu":
        torch.set_num_threads(threads)
    device = local_device(device_type, rank)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False,
        timeout=datetime.timedelta(seconds=start_timeout_s),
    )  # fmt: skip
    join_group(store, rank, world_size, device_type, timeout_s, start_timeout_s)
    serve(device, device_type, datetime.timedelta(seconds=timeout_s), store, start_timeout_s)


def serve(
    device: torch.device,
    device_type: str,
    timeout: datetime.timedelta,
    store: Any,
    start_timeout_s: float,
) -> None:
    """Obey rank 0 until SHUTDOWN (a failed collective raises and ends the process)."""
    channel = Channel(control_group(device_type, timeout), store, start_timeout_s)
    channel.meet("serving")  # NOTE: after the slow imports, so rank 0's first header is safe
    TensorParallelWorker(channel, device).loop()


class TensorParallelWorker:
    """One rank's instances and the calls on them, alike on every rank (module docstring)."""

    def __init__(self, channel: Channel, device: torch.device) -> None:
        self.channel = channel
        self.device = device
        self.instances: dict[int, RankBackend] = {}

    # -- rank 0 ----------------------------------------------------------------------

    def call(self, kind: Kind, instance: int = 0, *args: Any) -> Any:
        """Send `kind` and its arguments to every other rank, then run it here (rank 0)."""
        sizes = args[0].sizes if kind == Kind.STEP else []
        self.channel.header([int(kind), instance, *sizes])
        if kind == Kind.STEP:
            self.channel.buffer(args[0].pack())
        elif kind == Kind.LOAD:
            self.channel.object(args[0])
        return getattr(self, kind.name.lower())(instance, *args)

    # -- every other rank ------------------------------------------------------------

    def loop(self) -> None:
        """Receive each call of rank 0 and make it here, until SHUTDOWN."""
        while True:
            value, instance, *sizes = self.channel.header()
            try:
                kind = Kind(value)
            except ValueError:
                raise RuntimeError(f"unknown control message {value}") from None
            args: list[Any] = []
            if kind == Kind.STEP:
                buffer = torch.empty(FlatStep.packed_len(sizes[:4]), dtype=torch.long)
                args = [FlatStep.unpack(sizes[:4], self.channel.buffer(buffer))]
            elif kind == Kind.LOAD:
                args = [self.channel.object()]
            getattr(self, kind.name.lower())(instance, *args)
            if kind == Kind.SHUTDOWN:
                return

    # -- the calls -------------------------------------------------------------------

    def load(
        self, instance: int, spec: LoadSpec, tokenizer: Any = None
    ) -> tuple[RankBackend | None, str]:
        """Build this rank's part of `spec`'s model (None and the ranks' errors on failure)."""
        built, errors = RankBackend.build(spec, self.channel, self.device, tokenizer)
        if built is not None:
            self.instances[instance] = built
        return built, errors

    def step(self, instance: int, step: FlatStep) -> torch.Tensor:
        """This rank's part of one forward (the gathered logits on rank 0)."""
        return self.instances[instance].run_step(step)

    def describe(self, instance: int) -> list[dict[str, int]]:
        """Every rank's part of `instance`, in rank order."""
        return list(self.channel.all_gather(self.instances[instance].describe_rank()))

    def heartbeat(self, instance: int) -> None:
        self.channel.heartbeat()

    def unload(self, instance: int) -> None:
        backend = self.instances.pop(instance, None)
        if backend is not None:
            backend.free()

    def shutdown(self, instance: int) -> None:
        """Leave the group (only a clean shutdown does: after a failure, exiting is all)."""
        for backend in self.instances.values():
            backend.free()
        self.instances.clear()
        if dist.get_rank() != 0:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """A rank joined from the torchrun-style environment (another node, or torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--start-timeout-s", type=float, default=DEFAULT_START_TIMEOUT_S)
    args = parser.parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = int(os.environ["RANK"])
    if rank == 0:
        print("rank 0 is the serving process (carousel serve)", file=sys.stderr)
        return 2
    # NOTE: a launcher signals every rank at once (torchrun forwards SIGTERM, a terminal's ^C
    # reaches the process group); the server then drains, which needs this rank, so rank 0's
    # SHUTDOWN (or its silence past the timeout) is what ends a worker
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if device_type == "cpu":  # the node's cores, shared with the other ranks on it
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    device = local_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    store = environment_store(args.start_timeout_s)
    world_size = int(os.environ["WORLD_SIZE"])
    join_group(store, rank, world_size, device_type, args.timeout_s, args.start_timeout_s)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    serve(device, device_type, timeout, store, args.start_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
