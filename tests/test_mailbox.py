"""Engine outputs reach the event loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from schedulers.mailbox import mailbox_for


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
