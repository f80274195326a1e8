"""The `priority` policy: lower `priority` runs first, FCFS within a priority, less urgent
sequences preempted for more urgent ones, and aging so nobody waits forever."""

from __future__ import annotations

import asyncio

from backends.sim import SimBackend
from schedulers.base import SchedulerConfig
from schedulers.client import open_stream
from schedulers.engine import Engine
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.test_scheduler import make_scheduler, make_seq, run_step


def urgent(seq: Sequence, priority: int) -> Sequence:
    seq.priority = priority
    return seq


def run_until_idle(sched: object, steps: int = 200) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(steps):
        if not sched.has_work:  # type: ignore[attr-defined]
            break
        finished += run_step(sched)[1]  # type: ignore[arg-type]
    return finished


def test_an_urgent_request_arriving_into_a_full_batch_is_served_first() -> None:
    sched = make_scheduler("priority", max_num_seqs=2)
    slow = [urgent(make_seq(4, max_tokens=20), 5) for _ in range(2)]
    for seq in slow:
        sched.add(seq)
    run_step(sched)
    assert sched.running == slow
    late_low = urgent(make_seq(4, max_tokens=2), 5)
    high = urgent(make_seq(4, max_tokens=2), 0)
    sched.add(late_low)
    sched.add(high)
    batch, _ = run_step(sched)  # the least urgent running one (the later) makes room
    assert slow[1] in batch.preempted
    run_step(sched)
    assert high in sched.running and late_low in sched.waiting
    finished = run_until_idle(sched)
    assert finished.index(high) < finished.index(late_low)
    assert finished.index(high) < finished.index(slow[0])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_equal_priorities_are_first_come_first_served_and_never_preempt() -> None:
    sched = make_scheduler("priority", max_num_seqs=1)
    first, second, third = (urgent(make_seq(4, max_tokens=3), 2) for _ in range(3))
    for seq in (first, second, third):
        sched.add(seq)
    order = []
    for _ in range(30):
        batch, _ = run_step(sched)
        assert not batch.preempted
        order += [s for s in batch.seqs if s not in order]
    assert order == [first, second, third]


def test_out_of_kv_the_least_urgent_running_sequence_is_preempted() -> None:
    # 6 blocks of 4 slots: three 4-token prompts fit, their decodes soon do not
    sched = make_scheduler("priority", num_blocks=6, max_num_seqs=3)
    low, high, mid = (urgent(make_seq(4, 12), p) for p in (9, 0, 4))
    sched.add(low)
    run_step(sched)  # the least urgent is admitted first, so it is not last by admission
    sched.add(high)
    sched.add(mid)
    preempted: list[Sequence] = []
    for _ in range(60):
        batch, _ = run_step(sched)
        preempted += batch.preempted
        if not sched.has_work:
            break
    assert preempted and preempted[0] is low
    assert high not in preempted
    assert not sched.has_work


def test_aging_lets_a_waiting_request_through_a_stream_of_urgent_ones() -> None:
    def serve_low_under_stream(aging_s: float) -> bool:
        sched = make_scheduler("priority", max_num_seqs=1, aging_s=aging_s)
        low = urgent(make_seq(4, max_tokens=1), 9)
        low.arrival_time -= 100.0  # it has waited 100 s already
        sched.add(low)
        for _ in range(40):  # a new urgent request arrives every step
            sched.add(urgent(make_seq(4, max_tokens=1), 0))
            _, finished = run_step(sched)
            if low in finished:
                return True
        return False

    assert serve_low_under_stream(aging_s=1.0)  # 100 s waited: now more urgent than 0
    assert not serve_low_under_stream(aging_s=0.0)  # without aging it waits (documented)


def test_the_request_priority_reaches_the_engine() -> None:
    engine = Engine(SimBackend(time_scale=1.0), "priority", SchedulerConfig(max_num_seqs=1))
    engine.start()

    async def run() -> list[str]:
        done: list[str] = []

        async def one(name: str, priority: int, max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            stream = open_stream(engine, name, [[1, 2, 3]], params, priority)
            async for _, output in stream:
                if output.finished:
                    done.append(name)

        first = asyncio.ensure_future(one("busy", 5, 40))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, one("low", 5, 3), one("high", 0, 3))
        return done

    try:
        done = asyncio.run(run())
    finally:
        engine.stop()
    # one seat: "high" preempts the running "busy"; "busy" (earlier) then goes before "low"
    assert done == ["high", "busy", "low"]
