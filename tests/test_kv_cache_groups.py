"""KV cache groups: a model's sliding-window layers keep only their window's blocks.

The grouping of known layer patterns (Gemma 3 270M's and 1B's), the tiny Gemma 3 (a sliding
layer of window 5 beside a full one, 4-token blocks) serving a long answer exactly as HF
`generate` while its window table holds no more than the window's blocks, every block free
after a finish and an abort, and scripts/window_capacity.py's count on a layout small enough
to count by hand.
"""

from __future__ import annotations

import time

import pytest
import torch

from backends.torch.kv_cache import KVGroups, KVLayout, kv_groups
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_generic import tiny_generic_model
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_tokenizer
from schedulers.base import Scheduler, SchedulerConfig
from schedulers.batch import ExecuteOutput
from schedulers.block_manager import NO_BLOCK, BlockManager, blocks_for
from schedulers.llm import LLM
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob
from scripts.window_capacity import sequences_held
from tests.test_grammar_scheduling import Collected, soon_all_blocks_free
from tests.test_oracle import hf_greedy
from tests.test_prefix_cache_oracle import check_accounting_after_every_step

WINDOW = 5  # the tiny Gemma 3's sliding window
GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # five sliding in six


def test_gemma3_270m_splits_into_its_full_layers_and_five_sliding_groups_of_three() -> None:
    groups = kv_groups(GEMMA3_270M)
    assert groups == KVGroups(
        ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)),
        (None, 512, 512, 512, 512, 512),
    )
    assert groups.size == 3 and groups.sliding_windows == (512,) * 5
    assert [groups.slot_of(i) for i in (5, 0, 3, 16)] == [0, 0, 0, 2]


def test_a_sliding_remainder_gets_a_padded_group_and_one_kind_of_layer_no_groups() -> None:
    gemma3_1b = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 4 full, 22 sliding
    groups = kv_groups(gemma3_1b)
    assert groups is not None and groups.size == 4
    assert [len(layers) for layers in groups.layers] == [4, 4, 4, 4, 4, 4, 2]
    assert kv_groups([None] * 4) is None  # Llama
    assert kv_groups([4096] * 4) is None  # Mistral: one window for every layer
    assert kv_groups([None, None, None, 8]) is None  # fewer sliding than full: no saving


def test_a_block_holds_one_groups_layers() -> None:
    layout = KVLayout(18, 1, 256, 16, torch.bfloat16)
    grouped = KVLayout(18, 1, 256, 16, torch.bfloat16, kv_groups(GEMMA3_270M))
    assert layout.bytes_per_block == 6 * grouped.bytes_per_block == 2 * 18 * 16 * 256 * 2


def test_the_capacity_count_on_a_layout_counted_by_hand() -> None:
    # 2 layers (one full, one of window 4) of 1 head x 1 dim in fp32, 4-token blocks: a block
    # of both layers is 64 bytes, of one 32; the budget is 24 blocks of both, or 48 of one.
    # A 16-token sequence and its decode step hold 5 blocks of both layers; with groups, 5
    # full blocks and the window's 2 (the decode at position 16 reads keys 13-16, blocks 3
    # and 4: blocks 0-2 were dropped one per chunk).
    layout = KVLayout(2, 1, 1, 4, torch.float32)
    assert sequences_held(layout, 64 * 24, context=16, chunk=4) == 24 // 5
    grouped = KVLayout(2, 1, 1, 4, torch.float32, kv_groups([4, None]))
    assert sequences_held(grouped, 64 * 24, context=16, chunk=4) == 48 // (5 + 2)


@pytest.fixture(scope="module")
def gemma3() -> torch.nn.Module:
    model = tiny_generic_model("gemma3")
    model.generation_config.eos_token_id = None
    return model


def test_a_long_answer_keeps_only_the_windows_blocks_and_equals_hf(gemma3: torch.nn.Module) -> None:
    backend = TorchBackend(
        gemma3, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=96,
        model_impl="transformers",
    )  # fmt: skip
    assert backend.kv_cache_spec.windows == (WINDOW,)
    config = SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=True)
    llm = LLM(backend, "orca", config)
    errors = check_accounting_after_every_step(llm)
    held: list[tuple[int, int]] = []  # (real window blocks, full blocks) after each step

    def record(_: object) -> None:
        for seq in llm.engine.scheduler.running:
            if seq.window_tables:
                real = sum(b != NO_BLOCK for b in seq.window_tables[0])
                held.append((real, len(seq.block_table)))

    llm.engine.iteration_listeners.append(record)
    prompt = [(7 * i) % 90 + 3 for i in range(30)]
    try:
        (answer,) = llm.generate([prompt], [greedy(40)])
        aborted = Collected()  # an abort mid-answer, past the window, frees its blocks too
        llm.engine.submit("aborted", prompt[:20], greedy(60), aborted)
        deadline = time.monotonic() + 30
        while len(aborted.token_ids) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        llm.engine.abort("aborted")
        assert aborted.done.wait(30)
        assert soon_all_blocks_free(llm)
    finally:
        llm.close()
    assert answer.choices[0].token_ids == hf_greedy(gemma3, prompt, 40)
    assert not errors, errors[0]
    assert {o.finish_reason for o in aborted.outputs if o.finished} == {"abort"}
    # a step computes at most 8 tokens after the window's 4 earlier keys: 12 positions, in
    # at most 4 blocks; the full table grows with the context (68 tokens at the last step
    # the sequence ran in, before it finished)
    assert max(real for real, _ in held) <= blocks_for(WINDOW - 1 + 8, BLOCK_SIZE) + 1 == 4
    assert max(full for _, full in held) == blocks_for(68, BLOCK_SIZE) == 17


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_vllms_flag_keeps_every_block_and_the_same_answer(gemma3: torch.nn.Module) -> None:
    backend = TorchBackend(
        gemma3, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=96,
        model_impl="transformers", disable_hybrid_kv_cache_manager=True,
    )  # fmt: skip
    assert backend.kv_cache_spec.windows == () and backend.kv_cache.layout.groups is None
    prompt = [(5 * i) % 90 + 3 for i in range(30)]
    with LLM(backend, "orca", SchedulerConfig()) as llm:
        (answer,) = llm.generate([prompt], [greedy(20)])
    assert answer.choices[0].token_ids == hf_greedy(gemma3, prompt, 20)


def test_a_window_peak_is_the_most_blocks_any_step_of_that_size_spans() -> None:
    """Known answer, by brute force over every start position: the blocks a step of s tokens
    from position c holds in a window group (from its window's first key's block to its last
    token's) never exceed `window_peak`, and some position reaches it."""
    for window in range(1, 10):
        bm = BlockManager(8, BLOCK_SIZE, windows=(window,))
        for step in range(1, 13):
            spans = [(c + step - 1) // BLOCK_SIZE - bm.window_start(0, c) + 1 for c in range(40)]
            assert max(spans) == bm.window_peak(0, step), (window, step)


@pytest.mark.parametrize(("prompt_len", "step"), [(30, 30), (30, 8), (3, 3), (9, 4)])
def test_a_reservation_covers_the_most_a_sequence_ever_holds(prompt_len: int, step: int) -> None:
    """A sequence run step by step (its prompt in steps of `step` tokens, then one token a
    step to 60) never takes more free blocks than `num_reserved_blocks` reserves for it: the
    full group's 15 and each window group's peak for that step, against 45 for every group's
    blocks over the whole length."""
    bm = BlockManager(200, BLOCK_SIZE, windows=(WINDOW, 9))
    seq = Sequence(0, "r", list(range(3, 3 + prompt_len)), greedy(60 - prompt_len))
    reserved = bm.num_reserved_blocks(seq, seq.max_total_tokens, step)
    peak = 0
    while seq.num_computed_tokens < seq.max_total_tokens:
        left = seq.num_prompt_tokens - seq.num_computed_tokens
        num_tokens = min(step, left) if left > 0 else 1
        bm.allocate(seq, seq.num_computed_tokens + num_tokens)
        peak = max(peak, 200 - bm.num_free_blocks)
        seq.num_computed_tokens += num_tokens
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            seq.output_token_ids.append(5)
    bm.free(seq)
    assert bm.num_free_blocks == 200
    assert peak <= reserved < 45
    assert bm.num_new_blocks(Sequence(1, "s", [3] * 30, greedy(30)), 60) == 45
    assert reserved == 15 + sum(bm.window_peak(g, step) for g in (0, 1))


def test_static_seats_more_members_when_windows_hold_only_their_blocks(
    gemma3: torch.nn.Module,
) -> None:
    """A static batch reserves a sliding group's window, not its whole length: in a cache of
    60 blocks, three 30 + 30-token requests (15 full blocks each, at most 4 in the window group
    with 8-token steps: 57 in all) run in one batch, where reserving every group's blocks for
    the whole length (30 each) seated two; each answer equals HF `generate`, every step's
    accounting is right and every block is free after."""
    kwargs = dict(block_size=BLOCK_SIZE, max_model_len=60, model_impl="transformers")
    probe = TorchBackend(gemma3, tiny_tokenizer(), device="cpu", max_num_seqs=2, **kwargs)
    assert probe.kv_cache_spec.num_blocks == 60  # two sequences of 15 blocks in each group
    budget = 60 * probe.kv_cache.layout.bytes_per_block / 2**30
    probe.close()
    backend = TorchBackend(
        gemma3, tiny_tokenizer(), device="cpu", max_num_seqs=4, kv_cache_gb=budget, **kwargs
    )
    assert backend.kv_cache_spec.num_blocks == 60
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    llm = LLM(backend, "static", config)
    errors = check_accounting_after_every_step(llm)
    seats: list[int] = []
    llm.engine.iteration_listeners.append(lambda _: seats.append(len(llm.engine.scheduler.running)))
    prompts = [[(k * i) % 90 + 3 for i in range(30)] for k in (5, 7, 11)]
    try:
        answers = llm.generate(prompts, [greedy(30)] * 3)
        assert soon_all_blocks_free(llm)
    finally:
        llm.close()
    assert [a.choices[0].token_ids for a in answers] == [hf_greedy(gemma3, p, 30) for p in prompts]
    assert not errors, errors[0]
    assert max(seats) == 3


@pytest.mark.parametrize("num_blocks", range(20, 27))
def test_a_static_batch_sharing_a_cached_windows_blocks_never_runs_out(num_blocks: int) -> None:
    """Found in review: A and B both start from a cached 16-token prefix whose window blocks
    B still holds after A's window (15 tokens) moves past them; a reservation that left those
    shared blocks out of A's window share ran out of blocks mid-batch ("out of KV blocks",
    raised in `schedule`) from 20 blocks on. Every batch now finishes, B with A where both
    reservations fit, and every block is free after."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=4, enable_chunked_prefill=True,
        enable_prefix_caching=True, max_model_len=64,
    )  # fmt: skip
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=True, windows=(15,))
    sched = create_scheduler("static", config, bm)
    prefix = list(range(100, 116))
    run_to_the_end(sched, [Sequence(0, "warm", [*prefix, 400], greedy(1))])
    a = Sequence(1, "a", [*prefix, *range(200, 221)], greedy(3))
    b = Sequence(2, "b", [*prefix, 300, 301, 302], greedy(1))
    seats = run_to_the_end(sched, [a, b])
    assert a.is_finished and b.is_finished and bm.num_free_blocks == num_blocks
    assert max(seats) == (2 if num_blocks >= 22 else 1)


def run_to_the_end(sched: Scheduler, seqs: list[Sequence]) -> list[int]:
    """Add `seqs` and step `sched` until it has no work, a fake model sampling token 7; the
    members running at each step."""
    for seq in seqs:
        sched.add(seq)
    seats = []
    while sched.has_work:
        batch = sched.schedule()
        seats.append(len(sched.running))
        sampled = {
            seq.seq_id: TokenLogprob(7, 0.0)
            for i, seq in enumerate(batch.seqs)
            if batch.samples_after(i)
        }
        sched.update(batch, ExecuteOutput(sampled))
    return seats
