"""The control protocol between rank 0 and the other ranks (same calls, same order on each).

A fixed header `[kind, instance, N, B, W, R]` (step.py) announces each message; a STEP is
followed by its flat int64 buffer, a LOAD by its pickled spec, a DESCRIBE by an all-gather
of each rank's description, a HEARTBEAT by an all-reduce of one number.

Slow work (a worker getting ready to serve, each rank loading its shard) ends in `meet`: the
ranks wait for each other in the rendezvous store, up to the start timeout, so the group's
short collective timeout never has to cover a load on a busy machine.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from backends.torch.parallel.rendezvous import meet
from backends.torch.parallel.step import HEADER_LEN


class Kind(IntEnum):
    """What a control header announces."""

    STEP = 1
    HEARTBEAT = 2
    LOAD = 3
    UNLOAD = 4
    SHUTDOWN = 5
    DESCRIBE = 6


class Channel:
    """Rank 0's and the workers' side of the control protocol (same calls, same order)."""

    def __init__(
        self,
        group: Any,
        store: Any,
        start_timeout_s: float,
        failed: Callable[[], str | None] | None = None,
    ) -> None:
        self.group = group
        self.store = store
        self.start_timeout_s = start_timeout_s
        self.failed = failed

    def meet(self, name: str) -> None:
        """Wait until every rank has reached `name` (a new name each time; see module doc)."""
        meet(self.store, name, dist.get_rank(), dist.get_world_size(), self.start_timeout_s,
             self.failed)  # fmt: skip

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
