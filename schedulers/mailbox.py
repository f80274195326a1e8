"""Hand engine outputs to an asyncio loop with one wake-up per batch, not one per output.

The engine thread produces a burst of outputs every iteration (one per running sequence).
`loop.call_soon_threadsafe` per output would write to the loop's self-pipe and wake it once
per output; a mailbox queues them and schedules a single drain while one is pending. Inside
`held_wakeups()` (the engine delivers each iteration's outputs in one) the drain is scheduled
once the block ends, not at the first post: the loop then wakes to the whole burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Receiver(Protocol):
    """Where a mailbox delivers: `put_nowait`, called on the loop."""

    def put_nowait(self, item: Any) -> None: ...


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
    weakref.WeakKeyDictionary()
)
_REGISTRY_LOCK = threading.Lock()
#: per thread, the mailboxes to wake when its `held_wakeups()` block ends (None: outside one)
_HELD = threading.local()


class LoopMailbox:
    """Thread-safe `post(receiver, item)`; items reach `receiver.put_nowait` on the loop, in
    order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[Receiver, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, receiver: Receiver, item: Any) -> None:
        with self._lock:
            self._items.append((receiver, item))
            if self._scheduled:
                return
            self._scheduled = True
        held: list[LoopMailbox] | None = getattr(_HELD, "boxes", None)
        if held is not None:
            held.append(self)
        else:
            self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._scheduled = False
        for receiver, item in items:
            receiver.put_nowait(item)


class Inbox(Generic[T]):
    """A queue with one consumer task, for the loop's side of a mailbox: `put_nowait` and
    `await get()`, on the loop. (An `asyncio.Queue` keeps waiter lists, a task count and an
    Event for `join`; this runs once per token per stream on the event loop.)"""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> T:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:  # NOTE: a cancelled get leaves no waiter behind
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()


@contextlib.contextmanager
def held_wakeups() -> Iterator[None]:
    """Posts made on this thread inside the block wake their loops when it ends, once each.

    NOTE: a wake-up at the first post would start the loop's work on the burst while the rest
    is still being posted, and the two threads would trade the GIL to and fro (the wake-up's
    self-pipe write releases it); it cost the engine thread about 20 us a post at 32 streams.
    """
    if getattr(_HELD, "boxes", None) is not None:  # nested: the outer block wakes them
        yield
        return
    boxes: list[LoopMailbox] = []
    _HELD.boxes = boxes
    try:
        yield
    finally:
        _HELD.boxes = None
        for box in boxes:
            box._wake()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The one mailbox of `loop`."""
    with _REGISTRY_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = LoopMailbox(loop)
        return box
