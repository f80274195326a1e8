"""How the ranks of a tensor-parallel group find each other and form it.

Spawned ranks meet in a TCP store rank 0 serves on loopback; ranks started elsewhere meet in
the store at MASTER_ADDR:MASTER_PORT (torchrun's own agent store when it runs them). Every
rank first waits in the store until all are up (`start_timeout_s`: importing torch on a busy
machine takes a while), then all init the process group, whose own timeout (`timeout_s`)
bounds every later collective.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_START_TIMEOUT_S = 300.0
_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


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


def _prefix() -> str:
    return f"carousel/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def meet(
    store: Any,
    name: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    failed: Callable[[], str | None] | None = None,
    value: str = "",
) -> list[str]:
    """Wait in the store (up to `timeout_s`) until every rank has reached `name`.

    The ranks meet here before a collective that follows slow work (starting, loading a
    shard), so the group's own short timeout only ever covers the collective itself. Each
    call's `name` must be new (a key once set stays). `failed()` says why to stop waiting
    (a rank has exited); it returns the meeting's keys, in rank order, which hold `value`.
    """
    keys = [f"{_prefix()}/{name}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        reason = failed() if failed is not None else None
        if reason is not None:
            raise RuntimeError(f"a tensor-parallel rank failed before {name!r}: {reason}")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise TimeoutError(
                f"tensor-parallel ranks {', '.join(missing)} did not reach {name!r} within "
                f"{timeout_s:.0f} s"
            )
        time.sleep(0.05)
    return keys


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
    keys = meet(store, "ready", rank, world_size, start_timeout_s, failed, value=device_type)
    devices = [store.get(k).decode() for k in keys]
    if len(set(devices)) > 1:
        raise ValueError(f"the ranks disagree on the device type: {devices} (rank order)")
    dist.init_process_group(
        dist_backend(device_type),
        store=dist.PrefixStore(f"{_prefix()}/group", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
