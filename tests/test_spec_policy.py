"""The adaptive draft length: kept under high acceptance, off (then re-probed) under none,
and never flipping step to step on a signal that hovers at a threshold."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from schedulers.spec_decode.acceptance import AcceptanceTracker
from schedulers.spec_decode.budget import allot_drafts, draft_room, fit_fast_rows
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.load_switch import LoadSwitch
from schedulers.spec_decode.policy import (
    NO_SPECULATION,
    NoSpeculation,
    SpeculationPolicy,
    draft_policy,
)
from schedulers.spec_decode.stats import SpecDecodingStats

#: k = 4 with SGLang's default margins (up 0.0, down -0.25) and EMA weight 0.2
ADAPTIVE = SpeculativeConfig(4, adaptive=True)


def run(
    tracker: AcceptanceTracker, accepted: Callable[[int], int], steps: int, seq_id: int = 0
) -> list[int]:
    """The draft length granted at each step, the sequence accepting `accepted(k)` of k."""
    lengths = []
    for step in range(steps):
        k = tracker.draft_len(seq_id, step)
        lengths.append(k)
        tracker.observe(seq_id, k, accepted(k) if k else 0, step)
    return lengths


def flips(values: Iterable[int | bool]) -> int:
    values = list(values)
    return sum(a != b for a, b in zip(values, values[1:], strict=False))


def test_full_acceptance_keeps_the_full_draft_length() -> None:
    assert set(run(AcceptanceTracker(ADAPTIVE), lambda k: k, 1000)) == {4}


def test_no_acceptance_walks_k_down_to_zero_at_known_steps() -> None:
    # the EMA after t rejected steps is 4 * 0.8^t: at or below 2.25 (t = 3) k is 3, at or
    # below 1.25 (t = 6) 2, and at or below 0.25 (t = 13) it falls through 1 to 0
    lengths = run(AcceptanceTracker(ADAPTIVE), lambda k: 0, 13)
    assert lengths == [4, 4, 4, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2]
    tracker = AcceptanceTracker(ADAPTIVE)
    run(tracker, lambda k: 0, 13)
    assert tracker.state(0).k == 0 and tracker.state(0).probe_at == 12 + 16


def test_a_sequence_at_zero_is_reprobed_with_doubling_backoff() -> None:
    tracker = AcceptanceTracker(ADAPTIVE)
    lengths = run(tracker, lambda k: 0, 13 + 16 + 32 + 64 + 128 + 256 + 256 + 1)
    probes = [step for step, k in enumerate(lengths) if k and step >= 13]
    # off at step 12; each rejected one-token probe doubles the wait, up to 256 steps
    assert probes == [28, 60, 124, 252, 508, 764]
    assert all(lengths[step] == 1 for step in probes)


def test_an_accepted_probe_turns_drafting_back_on_and_climbs() -> None:
    tracker = AcceptanceTracker(ADAPTIVE)
    run(tracker, lambda k: 0, 13)  # off at step 12, probe due at step 28
    lengths = [tracker.draft_len(0, step) for step in range(13, 29)]
    assert lengths == [0] * 15 + [1]
    for step in range(28, 60):
        k = tracker.draft_len(0, step)
        tracker.observe(0, k, k, step)  # every draft accepted from now on
    assert tracker.state(0).k == 4 and tracker.state(0).backoff == 0


def test_k_settles_one_beyond_what_the_sequence_accepts() -> None:
    # the copied spans are two tokens long: k settles at 3 (SGLang's probe one beyond)
    lengths = run(AcceptanceTracker(ADAPTIVE), lambda k: min(k, 2), 300)
    assert lengths[-100:] == [3] * 100
    assert flips(lengths) == 1  # 4 -> 3, once


def hovering() -> Callable[[int], int]:
    """Acceptance alternating 1, 2, 1, 2, ... (capped at k): an EMA hovering at 1.5, the
    pivot between k = 2 and k = 3."""
    counter = itertools.count()
    return lambda k: min(k, 1 + next(counter) % 2)


def test_hysteresis_stops_k_flipping_on_acceptance_that_hovers_at_a_pivot() -> None:
    with_margins = SpeculativeConfig(3, adaptive=True)  # SGLang's: up 0.0, down -0.25
    bare = SpeculativeConfig(3, adaptive=True, up_hysteresis=0.0, down_hysteresis=0.0)
    assert flips(run(AcceptanceTracker(with_margins), hovering(), 400)) <= 1
    assert flips(run(AcceptanceTracker(bare), hovering(), 400)) >= 100  # what the margin stops


def test_sequences_keep_their_own_lengths() -> None:
    tracker = AcceptanceTracker(ADAPTIVE)
    for step in range(40):
        for seq_id, accepts in ((0, True), (1, False)):
            k = tracker.draft_len(seq_id, step)
            tracker.observe(seq_id, k, k if accepts else 0, step)
    assert tracker.state(0).k == 4 and tracker.state(1).k == 0
    tracker.release(1)
    assert tracker.draft_len(1, 40) == 4  # a new sequence under that id starts trusted


def test_steps_without_drafts_say_nothing_about_acceptance() -> None:
    tracker = AcceptanceTracker(ADAPTIVE)
    for step in range(100):
        tracker.observe(0, 0, 0, step)  # no lookup match: nothing verified
    assert tracker.state(0).k == 4 and tracker.state(0).ema == 4.0


def test_load_hovering_at_the_threshold_flips_the_switch_once() -> None:
    switch = LoadSwitch(max_concurrency=16, hysteresis=2, min_switch_steps=8)
    states = [switch.update(16 + (-1 if step % 2 else 1), step) for step in range(200)]
    assert states[0] is False and flips(states) == 0 and switch.num_switches == 1


def test_a_wide_oscillation_flips_at_most_once_per_dwell() -> None:
    switch = LoadSwitch(max_concurrency=16, hysteresis=2, min_switch_steps=8)
    states = [switch.update(10 if step % 2 else 20, step) for step in range(200)]
    assert switch.num_switches <= 200 // 8 + 1
    bare = LoadSwitch(max_concurrency=16, hysteresis=0, min_switch_steps=1)
    assert flips(bare.update(15 if step % 2 else 17, step) for step in range(200)) == 199
    assert flips(states) == switch.num_switches - 1  # the first switch is at step 0


def test_the_switch_follows_sustained_load_both_ways() -> None:
    switch = LoadSwitch(max_concurrency=8, hysteresis=2, min_switch_steps=4)
    load = [4] * 10 + [12] * 10 + [7] * 10 + [5] * 10
    states = [switch.update(rows, step) for step, rows in enumerate(load)]
    assert states[:10] == [True] * 10
    assert states[10:30] == [False] * 20  # 7 is not at or below 8 - 2: still off
    assert states[30:] == [True] * 10
    assert switch.num_switches == 2


def test_no_threshold_means_drafting_at_any_load() -> None:
    switch = LoadSwitch(max_concurrency=None)
    assert all(switch.update(rows, step) for step, rows in enumerate(range(0, 1000, 7)))
    assert switch.num_switches == 0


def test_speculation_off_is_a_constant_answer() -> None:
    assert draft_policy(None) is NO_SPECULATION
    assert not NO_SPECULATION.enabled and isinstance(NO_SPECULATION, NoSpeculation)
    assert {NO_SPECULATION.begin_step(rows) for rows in range(100)} == {0}
    NO_SPECULATION.observe(0, 4, 4)
    assert NO_SPECULATION.draft_len(0) == 0 and vars(NO_SPECULATION) == {}


def test_a_step_switched_off_asks_no_sequence_anything() -> None:
    policy = SpeculationPolicy(
        SpeculativeConfig(4, adaptive=True, max_concurrency=2, concurrency_hysteresis=1)
    )
    assert policy.begin_step(num_decode_rows=3) == 0
    assert [policy.draft_len(seq_id) for seq_id in range(5)] == [0] * 5
    assert policy.tracker is not None and policy.tracker._states == {}  # no state created


def test_the_static_policy_drafts_k_for_everyone_below_the_threshold() -> None:
    policy = draft_policy(SpeculativeConfig(3, max_concurrency=4, concurrency_hysteresis=1))
    assert policy.begin_step(2) == 3 and policy.draft_len(7) == 3
    policy.observe(7, 3, 0)  # acceptance is not tracked without `adaptive`
    assert policy.begin_step(2) == 3 and policy.draft_len(7) == 3
    assert policy.begin_step(5) == 0


def test_the_adaptive_policy_caps_each_sequence_by_the_step() -> None:
    policy = SpeculationPolicy(ADAPTIVE)
    for _ in range(13):
        policy.begin_step(1)
        policy.observe(0, policy.draft_len(0), 0)
        policy.observe(1, policy.draft_len(1), policy.draft_len(1))
    policy.begin_step(1)
    assert (policy.draft_len(0), policy.draft_len(1)) == (0, 4)
    policy.release(0)
    assert policy.draft_len(0) == 4


def decoding(max_tokens: int, num_prompt: int, num_output: int) -> Sequence:
    seq = Sequence(0, "r", [1] * num_prompt, SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = [2] * num_output
    return seq


def test_drafts_stop_where_nothing_more_could_be_emitted() -> None:
    assert draft_room(decoding(10, 5, 3), max_model_len=100) == 6  # 7 left: 6 drafts + 1
    assert draft_room(decoding(10, 5, 9), max_model_len=100) == 0  # one token left
    assert draft_room(decoding(100, 90, 6), max_model_len=100) == 4  # the context window
    assert draft_room(decoding(100, 99, 1), max_model_len=100) == 0


def test_drafts_are_cut_in_row_order_where_the_budget_ends() -> None:
    assert allot_drafts([4, 4, 4], spare=6) == [4, 2, 0]
    assert allot_drafts([4, 0, 3], spare=100) == [4, 0, 3]
    assert allot_drafts([4, 4], spare=0) == [0, 0]
    assert allot_drafts([4], spare=-3) == [0]


def test_a_step_past_the_fast_rows_keeps_its_drafts_only_where_they_emit_more() -> None:
    # one row, R = 4, k = 4: fitted k = 3. At p = 0.8 the four drafts yield 1 + 2.3616 and
    # three 1 + 1.952 tokens: fitting pays from a speedup of 3.3616 / 2.952 = 1.139 up
    assert fit_fast_rows([4], plain_rows=1, fast_rows=4, speedup=1.14, p=0.8) == [3]
    assert fit_fast_rows([4], plain_rows=1, fast_rows=4, speedup=1.13, p=0.8) == [4]
    # two rows: the three spare rows go one at a time, row after row
    assert fit_fast_rows([4, 4], plain_rows=2, fast_rows=5, speedup=9.0, p=0.8) == [2, 1]
    # four rows at R = 4 would draft nothing: 4 tokens * 1.3 < 4 * 3.36
    assert fit_fast_rows([4] * 4, plain_rows=4, fast_rows=4, speedup=1.3, p=0.8) == [4] * 4


def test_steps_already_past_or_within_the_fast_rows_keep_their_drafts() -> None:
    assert fit_fast_rows([4], plain_rows=5, fast_rows=4, speedup=9.0, p=0.8) == [4]
    assert fit_fast_rows([2, 1], plain_rows=1, fast_rows=4, speedup=9.0, p=0.8) == [2, 1]
    assert fit_fast_rows([], plain_rows=3, fast_rows=4, speedup=9.0, p=0.8) == []


def test_the_per_draft_acceptance_is_accepted_over_accepted_and_rejections() -> None:
    stats = SpecDecodingStats(num_speculative_tokens=4)
    assert stats.draft_acceptance() == 0.8  # the prior alone
    rng = random.Random(0)
    for _ in range(5000):  # geometric acceptance at p = 0.6, drafts of 4
        accepted = 0
        while accepted < 4 and rng.random() < 0.6:
            accepted += 1
        stats.observe(4, accepted)
    assert abs(stats.draft_acceptance(prior=(0.0, 0.0)) - 0.6) < 0.02
