"""Hand engine outputs to an asyncio loop with one wake-up per batch, not one per output.

The engine thread produces a burst of outputs every iteration (one per running sequence).
`loop.call_soon_threadsafe` per output would write to the loop's self-pipe and wake it once
per output; a mailbox queues them and schedules a single drain while one is pending.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any

_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
    weakref.WeakKeyDictionary()
)
_REGISTRY_LOCK = threading.Lock()


class LoopMailbox:
    """Thread-safe `post(queue, item)`; items reach `queue.put_nowait` on the loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
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
        for queue, item in items:
            queue.put_nowait(item)


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The one mailbox of `loop`."""
    with _REGISTRY_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = LoopMailbox(loop)
        return box
