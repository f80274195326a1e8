"""`fair`: per-principal virtual token counters (Sheng et al., OSDI '24): the least-served
principal is admitted first, weights scale the share, idle time banks no credit, and a light
user is never stuck behind a heavy one's backlog."""

from __future__ import annotations

import dataclasses

import pytest

from schedulers.sequence import Sequence
from tests.test_scheduler import make_scheduler, make_seq, run_step
from tests.test_sjf import admitted_order


def of(name: str, seq: Sequence) -> Sequence:
    seq.sampling_params = dataclasses.replace(seq.sampling_params, principal=name)
    return seq


def test_a_light_user_goes_ahead_of_a_heavy_users_backlog() -> None:
    sched = make_scheduler("fair", max_num_seqs=1)
    heavy = [of("heavy", make_seq(4, 4)) for _ in range(6)]
    light = of("light", make_seq(4, 4))
    for seq in (*heavy, light):
        sched.add(seq)
    order = admitted_order(sched)
    assert order.index(light) <= 1  # orca would run it seventh
    assert [s for s in order if s is not light] == heavy  # FCFS within a principal


def test_principals_alternate_under_equal_weights() -> None:
    sched = make_scheduler("fair", max_num_seqs=1)
    a = [of("a", make_seq(4, 4)) for _ in range(4)]
    b = [of("b", make_seq(4, 4)) for _ in range(4)]
    for seq in (*a, *b):
        sched.add(seq)
    users = [s.sampling_params.principal for s in admitted_order(sched)]
    assert users == ["a", "b"] * 4


def test_a_weight_of_two_gets_twice_the_admissions() -> None:
    sched = make_scheduler("fair", max_num_seqs=1, fair_weights="gold=2")
    gold = [of("gold", make_seq(4, 4)) for _ in range(8)]
    plain = [of("plain", make_seq(4, 4)) for _ in range(8)]
    for seq in (*gold, *plain):
        sched.add(seq)
    first_nine = [s.sampling_params.principal for s in admitted_order(sched)][:9]
    assert first_nine.count("gold") == 6 and first_nine.count("plain") == 3


def test_a_returning_principal_banks_no_credit_while_idle() -> None:
    sched = make_scheduler("fair", max_num_seqs=1)
    for _ in range(5):  # "busy" is served alone for a while
        sched.add(of("busy", make_seq(4, 4)))
    admitted_order(sched)
    late = [of("late", make_seq(4, 4)) for _ in range(3)]
    busy = [of("busy", make_seq(4, 4)) for _ in range(3)]
    for seq in (*late, *busy):
        sched.add(seq)
    users = [s.sampling_params.principal for s in admitted_order(sched)]
    assert users[:4] != ["late"] * 3 + ["busy"]  # without the lift "late" would run 3 in a row
    assert "busy" in users[:3]


def test_no_principal_waits_beyond_the_counter_bound() -> None:
    # a steady heavy stream never keeps the light user waiting for more than one heavy job
    sched = make_scheduler("fair", max_num_seqs=1)
    for _ in range(6):
        sched.add(of("heavy", make_seq(4, 4)))
    light = [of("light", make_seq(4, 4)) for _ in range(3)]
    for seq in light:
        sched.add(seq)
    order: list[Sequence] = []
    for _ in range(200):
        if not sched.has_work:
            break
        if len(order) < 20:
            sched.add(of("heavy", make_seq(4, 4)))
        batch, _ = run_step(sched)
        order += [s for s in batch.seqs if s not in order]
    positions = [order.index(s) for s in light]
    assert positions == sorted(positions)
    assert all(b - a <= 2 for a, b in zip([-1, *positions], positions, strict=False))


def test_bad_weights_are_refused() -> None:
    for bad in ("gold", "gold=0", "=2", "gold=x"):
        with pytest.raises(ValueError):
            make_scheduler("fair", fair_weights=bad)  # type: ignore[arg-type]
