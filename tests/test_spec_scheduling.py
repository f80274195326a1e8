"""Speculative decoding in the scheduler, with no weights: drafts join every policy's steps
under the token budget and the free KV, verified rows advance by what they accepted, only real
tokens' blocks are cached, and the emitted tokens stop where a sampled token would.

The fake model continues every sequence with `PATTERN`, position by position, and its prompts
are that pattern, so prompt lookup drafts exactly what it will say (all accepted) unless a
test makes it disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from schedulers.backend import FastRows
from schedulers.base import Scheduler, SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager, blocks_for
from schedulers.registry import available_schedulers, create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import FinishReason, Sequence, TokenLogprob
from schedulers.spec_decode.config import SpeculativeConfig

PATTERN = [5, 9, 13, 2, 7, 11]
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
_ids = iter(range(10**9))

Truth = Callable[[int], int]


def truth(position: int) -> int:
    """The fake model's token at `position` of any sequence."""
    return PATTERN[position % len(PATTERN)]


def make_seq(prompt_len: int = 12, max_tokens: int = 20, **params: Any) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=[truth(p) for p in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
    )


def make_scheduler(
    name: str = "orca",
    num_blocks: int = 64,
    block_size: int = 4,
    spec: SpeculativeConfig | None = SPEC,
    prefix_caching: bool = True,
    **knobs: Any,
) -> Scheduler:
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)}
    config = SchedulerConfig(
        speculative_config=spec, **{k: v for k, v in knobs.items() if k in shared}
    )
    options = {k: v for k, v in knobs.items() if k not in shared}
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return create_scheduler(name, config, bm, options)


def execute(batch: Batch, model: Truth = truth) -> ExecuteOutput:
    """What a backend returns for `batch` when the model says `model(position)`."""
    out = ExecuteOutput()
    for i, seq in enumerate(batch.seqs):
        if not batch.samples_after(i):
            continue
        position = seq.num_tokens
        drafts = batch.draft_token_ids.get(i)
        if drafts is None:
            out.sampled[seq.seq_id] = TokenLogprob(model(position), 0.0)
            continue
        emitted = []
        for j, draft in enumerate(drafts):
            emitted.append(model(position + j))
            if emitted[-1] != draft:
                break
        else:
            emitted.append(model(position + len(drafts)))
        out.verified[seq.seq_id] = [TokenLogprob(t, 0.0) for t in emitted]
    return out


def run_step(sched: Scheduler, model: Truth = truth) -> tuple[Batch, list[Sequence]]:
    batch = sched.schedule()
    finished = sched.update(batch, execute(batch, model))
    holders = [*sched.running, *sched.waiting]
    sched.block_manager.check_invariants([s for s in holders if s.block_table])
    return batch, finished


def run_all(sched: Scheduler, seqs: list[Sequence], model: Truth = truth) -> list[Batch]:
    for seq in seqs:
        sched.add(seq)
    batches = []
    while sched.has_work:
        batch, _ = run_step(sched, model)
        batches.append(batch)
        assert len(batches) < 500
    return batches


@pytest.mark.parametrize("name", available_schedulers())
def test_every_policy_verifies_drafts_and_emits_what_plain_decoding_does(name: str) -> None:
    outputs = {}
    steps = {}
    for spec in (None, SPEC):
        sched = make_scheduler(name, spec=spec, max_num_seqs=4)
        seqs = [make_seq(12 + i, max_tokens=10 + 3 * i) for i in range(3)]
        batches = run_all(sched, seqs)
        outputs[spec] = [s.output_token_ids for s in seqs]
        steps[spec] = len(batches)
        assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert outputs[SPEC] == outputs[None]
    assert outputs[None][0] == [truth(12 + p) for p in range(10)]
    assert steps[SPEC] < steps[None]  # drafts were accepted, several tokens per step


def test_a_row_advances_by_what_it_accepted_and_caches_only_real_tokens() -> None:
    """A model that disagrees with every draft: each verified row emits one token, its
    rejected drafts' slots are not computed, and every cached block holds the sequence's
    own tokens (run_step checks the holders against the cache after every step)."""
    sched = make_scheduler()
    seq = make_seq(12, max_tokens=9)
    sched.add(seq)
    run_step(sched)  # the prefill

    def contrary(position: int) -> int:
        return 100 + position

    verified = 0
    while not seq.is_finished:
        batch, _ = run_step(sched, contrary)
        verified += batch.num_draft_tokens > 0
        if not seq.is_finished:
            assert seq.num_computed_tokens == seq.num_tokens - 1
    assert verified >= 1
    assert seq.output_token_ids == [truth(12), *(100 + p for p in range(13, 21))]
    stats = sched.drafter.stats  # type: ignore[union-attr]
    assert stats.num_drafts == verified and stats.num_accepted_tokens == 0


def test_drafts_take_only_the_budget_left_after_every_rows_own_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=6, enable_chunked_prefill=True)
    first = make_seq(12)
    sched.add(first)
    run_step(sched)  # 6 prompt tokens
    run_step(sched)  # the other 6
    batch, _ = run_step(sched)  # a decode alone: 1 + 3 drafts
    assert batch.num_scheduled_tokens == [4] and batch.num_draft_tokens == 3
    sched.add(make_seq(3))
    batch, _ = run_step(sched)  # the decode's token and a 3-token prompt: room for 2 drafts
    assert batch.num_scheduled_tokens == [3, 3]
    assert batch.draft_token_ids == {0: [truth(17), truth(18)]}  # 13-16 came in one step
    sched.add(make_seq(30))
    batch, _ = run_step(sched)  # two decodes' tokens, then a 4-token chunk: no room
    assert batch.num_scheduled_tokens == [1, 1, 4] and not batch.draft_token_ids


def test_a_kv_shortfall_cuts_the_drafts_and_preempts_no_one() -> None:
    """Two sequences fill all but a slot or two of the cache: their drafts shrink to what the
    free blocks hold, and nobody is preempted for a draft."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2, prefix_caching=False)
    a, b = make_seq(13, max_tokens=6), make_seq(13, max_tokens=6)
    for seq in (a, b):
        sched.add(seq)
    batch, _ = run_step(sched)  # two prefills: 4 blocks each
    assert sched.block_manager.num_free_blocks == 0
    batch, _ = run_step(sched)
    # both decode at position 13, inside their 4th block: room for 2 more slots each
    assert batch.draft_token_ids == {0: [truth(14), truth(15)], 1: [truth(14), truth(15)]}
    assert not batch.preempted and sched.num_preemptions == 0


def test_static_keeps_drafts_inside_each_members_worst_case() -> None:
    """A static batch reserves prompt + max_tokens per member; drafts never need more."""
    block_size = 4
    seqs = [make_seq(10 + i, max_tokens=7 + i) for i in range(3)]
    worst = sum(blocks_for(s.max_total_tokens, block_size) for s in seqs)
    sched = make_scheduler("static", num_blocks=worst, block_size=block_size, max_num_seqs=3)
    for seq in seqs:
        sched.add(seq)
    drafted = 0
    while sched.has_work:
        batch, _ = run_step(sched)
        drafted += batch.num_draft_tokens
        for seq in seqs:
            assert len(seq.block_table) <= blocks_for(seq.max_total_tokens, block_size)
    assert drafted and sched.num_preemptions == 0
    assert [s.output_token_ids for s in seqs] == [
        [truth(s.num_prompt_tokens + p) for p in range(s.sampling_params.max_tokens)] for s in seqs
    ]


class _ReadyGrammar:
    """A grammar stand-in that allows every token (only its presence matters here)."""

    error = None
    is_terminated = False

    def is_ready(self) -> bool:
        return True

    def accept(self, token_id: int) -> bool:
        return True


@pytest.mark.parametrize(
    "kind", ["grammar", "repetition_penalty", "presence_penalty", "frequency_penalty"]
)
def test_constrained_and_penalised_rows_get_no_drafts(kind: str) -> None:
    sched = make_scheduler()
    params = {} if kind == "grammar" else {kind: 1.2 if kind == "repetition_penalty" else 0.5}
    held, free = make_seq(12, **params), make_seq(12)
    if kind == "grammar":
        held.grammar = _ReadyGrammar()  # type: ignore[assignment]
    for seq in (held, free):
        sched.add(seq)
    drafted_rows: set[int] = set()
    while sched.has_work:
        batch, _ = run_step(sched)
        drafted_rows |= {batch.seqs[i].seq_id for i in batch.draft_token_ids}
    assert drafted_rows == {free.seq_id}


def test_a_stop_token_inside_the_accepted_run_drops_what_follows() -> None:
    sched = make_scheduler()
    seq = make_seq(12, max_tokens=20, stop_token_ids=(truth(15),))
    sched.add(seq)
    run_step(sched)  # prefill: samples position 12
    batch = sched.schedule()  # decode of 12 with drafts for 13, 14, 15
    assert batch.draft_token_ids == {0: [truth(13), truth(14), truth(15)]}
    out = execute(batch)
    assert len(out.verified[seq.seq_id]) == 4  # 3 accepted + the bonus at 16
    assert sched.update(batch, out) == [seq]
    assert seq.output_token_ids == [truth(p) for p in range(12, 16)]
    assert [t.token_id for t in out.verified[seq.seq_id]] == [truth(p) for p in (13, 14, 15)]
    assert seq.finish_reason is FinishReason.STOP
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 9])
def test_max_tokens_is_never_passed_by_a_verified_step(max_tokens: int) -> None:
    sched = make_scheduler()
    seq = make_seq(12, max_tokens=max_tokens)
    batches = run_all(sched, [seq])
    assert seq.output_token_ids == [truth(p) for p in range(12, 12 + max_tokens)]
    assert seq.finish_reason is FinishReason.LENGTH
    assert all(b.num_draft_tokens < max_tokens for b in batches)


def test_a_config_that_finds_no_drafts_schedules_exactly_as_none() -> None:
    """Prompts with no repeated n-gram: every step, token and block id as without the config."""
    runs = []
    for spec in (None, SPEC):
        sched = make_scheduler(spec=spec, max_num_seqs=2, num_blocks=12)
        seqs = [
            Sequence(
                seq_id=100 + i,
                request_id=f"q{i}",
                prompt_token_ids=list(range(40 * i + 1, 40 * i + 14)),
                sampling_params=SamplingParams(max_tokens=6, temperature=0.0),
            )
            for i in range(3)
        ]
        history = []
        for seq in seqs:
            sched.add(seq)
        while sched.has_work:
            batch, _ = run_step(sched, lambda p: 1000 + p)
            tables = [list(s.block_table) for s in batch.seqs]
            history.append(([s.seq_id for s in batch.seqs], batch.num_scheduled_tokens, tables))
            assert not batch.draft_token_ids
        runs.append((history, [s.output_token_ids for s in seqs]))
    assert runs[0] == runs[1]


def test_a_lone_sequence_keeps_its_verify_steps_within_the_backends_fast_rows() -> None:
    """With int4 linears up to R = 4 rows, twice as fast there, one decoding sequence verifies
    three drafts (four rows) rather than k = 5 (six rows), and says the same."""
    spec = dataclasses.replace(SPEC, num_speculative_tokens=5, prompt_lookup_max=5)
    outputs = {}
    for fast in (None, FastRows(rows=4, speedup=2.0)):
        sched = make_scheduler(spec=spec)
        assert sched.drafter is not None
        sched.drafter.fast_rows = fast
        seq = make_seq(12, max_tokens=30)
        batches = run_all(sched, [seq])
        verify = [b for b in batches if b.num_draft_tokens]
        widest = max(b.total_tokens for b in verify)  # drafts included
        assert widest == (6 if fast is None else 4)
        outputs[fast] = seq.output_token_ids
    assert outputs[None] == list(outputs.values())[1] == [truth(12 + p) for p in range(30)]
