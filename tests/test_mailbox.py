"""Engine outputs reach the event loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from schedulers.mailbox import Inbox, held_wakeups, mailbox_for


async def test_a_burst_from_another_thread_arrives_in_order_with_one_wakeup() -> None:
    loop = asyncio.get_running_loop()
    box = mailbox_for(loop)
    assert mailbox_for(loop) is box
    queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(3)]
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        nonlocal wakeups
        wakeups += 1
        return original(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        thread = threading.Thread(target=lambda: [box.post(queues[i % 3], i) for i in range(300)])
        thread.start()
        thread.join()
        got = [[await q.get() for _ in range(100)] for q in queues]
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert got == [list(range(k, 300, 3)) for k in range(3)]
    assert wakeups == 1


async def test_an_inbox_hands_items_over_in_order_and_survives_a_cancelled_get() -> None:
    inbox: Inbox[int] = Inbox()
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not reader.done()  # it waits for an item
    inbox.put_nowait(1)
    inbox.put_nowait(2)
    assert await reader == 1
    assert await inbox.get() == 2
    assert inbox.empty()


async def test_posts_in_a_held_block_wake_the_loop_once_when_it_ends() -> None:
    loop = asyncio.get_running_loop()
    box = mailbox_for(loop)
    inbox: Inbox[int] = Inbox()
    woke: list[int] = []
    original = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        woke.append(len(box._items))  # the items queued when the wake-up went out
        return original(callback, *args)

    def burst() -> None:
        with held_wakeups():
            for i in range(5):
                box.post(inbox, i)
                with held_wakeups():  # nested: the outer block wakes
                    box.post(inbox, 10 + i)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        thread = threading.Thread(target=burst)
        thread.start()
        thread.join()
        got = [await inbox.get() for _ in range(10)]
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert woke == [10]  # one wake-up, after the whole burst was posted
    assert got == [v for i in range(5) for v in (i, 10 + i)]
