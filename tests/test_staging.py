"""The staged step inputs (backends/torch/runner/staging.py) equal `prepare_inputs`' for random
batches driven through the real block manager: prefills, chunked prefills, decodes, mixed
steps, prefix hits (and the cached-block swaps after a step), preemption by recompute; and
padded rows only ever point at the scratch KV block."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch.runner.inputs import prepare_inputs
from backends.torch.runner.staging import InputStager
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

CPU = torch.device("cpu")
NUM_BLOCKS = 48


def assert_same_input(staged: object, batch: Batch, block_size: int) -> None:
    want = prepare_inputs(batch, block_size, CPU)
    got = staged.model_input  # type: ignore[attr-defined]
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.positions.tolist() == want.positions.tolist()
    a, b = got.layout, want.layout
    for name in ("cu_seqlens_q", "context_lens", "slot_mapping", "block_tables", "decode_indices"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for name in ("query_starts", "seqlens_q", "seqlens_k", "decode_max_blocks", "prefill_indices"):
        assert getattr(a, name) == getattr(b, name), name


class Driver:
    """A small random scheduler over the real `BlockManager` (prefix caching on)."""

    def __init__(self, rng: random.Random, block_size: int, num_seqs: int) -> None:
        self.rng, self.bs = rng, block_size
        self.blocks = BlockManager(NUM_BLOCKS, block_size, enable_prefix_caching=True)
        shared = [rng.randrange(50) for _ in range(rng.randrange(0, 3 * block_size))]
        self.waiting = [
            Sequence(i, f"r{i}", shared + [rng.randrange(50) for _ in range(rng.randrange(1, 20))],
                     SamplingParams(max_tokens=64))
            for i in range(num_seqs)
        ]  # fmt: skip
        self.running: list[Sequence] = []

    def step(self, iteration: int) -> Batch:
        batch = Batch(iteration)
        rng = self.rng
        if self.running and rng.random() < 0.15:  # preemption by recompute
            victim = self.running.pop(rng.randrange(len(self.running)))
            self.blocks.free(victim)
            victim.num_computed_tokens = 0
            batch.preempted.append(victim)
            self.waiting.append(victim)
        for seq in list(self.running):
            behind = seq.num_tokens - seq.num_computed_tokens
            n = behind if behind == 1 else rng.randrange(1, behind + 1)  # chunks
            if self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                self.blocks.allocate(seq, seq.num_computed_tokens + n)
                batch.add(seq, n)
        while self.waiting and rng.random() < 0.7:
            seq = self.waiting[0]
            hit = self.blocks.computed_prefix(seq)
            n = rng.randrange(1, seq.num_tokens - hit.num_tokens + 1)
            if not self.blocks.can_allocate(seq, hit.num_tokens + n, hit):
                break
            self.blocks.allocate(seq, hit.num_tokens + n, hit)
            self.waiting.pop(0)
            self.running.append(seq)
            batch.add(seq, n)
        return batch

    def batches(self, steps: int) -> Iterator[Batch]:
        """Each non-empty batch of up to `steps` steps, until every sequence has finished."""
        for iteration in range(steps):
            batch = self.step(iteration)
            if not batch.is_empty:
                yield batch
            elif not self.running and not self.waiting:
                return

    def update(self, batch: Batch) -> None:
        for i, seq in enumerate(batch.seqs):
            level = batch.samples_after(i)
            seq.num_computed_tokens += batch.num_scheduled_tokens[i]
            if level:
                seq.output_token_ids.append(self.rng.randrange(50))
            self.blocks.cache_full_blocks(seq)
            if seq.num_output_tokens >= 6:  # finished
                self.running.remove(seq)
                self.blocks.free(seq)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_seqs=st.integers(1, 8),
)
def test_staged_inputs_equal_prepare_inputs(seed: int, block_size: int, num_seqs: int) -> None:
    rng = random.Random(seed)
    driver = Driver(rng, block_size, num_seqs)
    stager = InputStager(block_size, 4, NUM_BLOCKS, CPU, token_capacity=8, max_num_seqs=2)
    for batch in driver.batches(40):
        assert_same_input(stager.stage(batch), batch, block_size)
        driver.update(batch)
        for seq in batch.seqs:
            if seq.block_table == [] and seq.num_output_tokens >= 6:
                stager.release(seq.seq_id)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pad=st.integers(0, 5))
def test_padded_rows_point_at_the_scratch_block(seed: int, pad: int) -> None:
    rng = random.Random(seed)
    driver = Driver(rng, 4, 4)
    stager = InputStager(4, 16, NUM_BLOCKS, CPU)  # 16 blocks: the longest sequence's 38 slots
    for iteration in range(30):
        batch = driver.step(iteration)
        if batch.is_empty:
            continue
        n = len(batch.seqs)
        staged = stager.stage(batch, pad_to=n + pad, full_width=True)
        layout = staged.model_input.layout
        assert staged.num_seqs == n and layout.num_seqs == n + pad
        assert layout.block_tables.shape == (n + pad, 16)
        real = int(layout.cu_seqlens_q[n])
        want = prepare_inputs(batch, 4, CPU)
        assert layout.slot_mapping[:real].tolist() == want.layout.slot_mapping.tolist()
        padded_slots = layout.slot_mapping[real:]
        assert padded_slots.tolist() == [NUM_BLOCKS * 4] * pad  # slot 0 of the scratch block
        assert (layout.block_tables[n:] == NUM_BLOCKS).all()
        assert layout.seqlens_q[n:] == (1,) * pad and layout.seqlens_k[n:] == (1,) * pad
        # NOTE: no real sequence ever holds the scratch block
        assert NUM_BLOCKS not in layout.block_tables[:n].flatten().tolist()
        driver.update(batch)


def test_rows_asked_for_are_staged_as_logits_indices() -> None:
    driver = Driver(random.Random(3), 4, 5)
    stager = InputStager(4, 8, NUM_BLOCKS, CPU)
    batch = driver.step(0)
    while len(batch.seqs) < 2:
        driver.update(batch)
        batch = driver.step(1)
    staged = stager.stage(batch, rows=[1])
    assert staged.logits_indices is not None and staged.logits_indices.tolist() == [1]
    assert stager.stage(batch).logits_indices is None


class DraftDriver(Driver):
    """`Driver` whose decoding rows verify a few random drafts (blocks allocated for them),
    each step accepting a random number of them, as the scheduler advances a verified row."""

    def step(self, iteration: int) -> Batch:
        batch = super().step(iteration)
        for i, seq in enumerate(batch.seqs):
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.num_output_tokens:
                continue  # only a decode drafts
            k = self.rng.randrange(0, 4)
            if k and self.blocks.can_allocate(seq, seq.num_computed_tokens + 1 + k):
                self.blocks.allocate(seq, seq.num_computed_tokens + 1 + k)
                batch.add_drafts(i, [self.rng.randrange(50) for _ in range(k)])
        return batch

    def update(self, batch: Batch) -> None:
        for i, seq in enumerate(batch.seqs):
            drafts = batch.draft_token_ids.get(i, [])
            if not drafts:
                continue
            accepted = self.rng.randrange(0, len(drafts) + 1)
            seq.num_computed_tokens += 1 + accepted  # the base update adds the row's 1 after
            seq.output_token_ids += drafts[:accepted]
            batch.num_scheduled_tokens[i] = 0
        super().update(batch)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]))
def test_a_step_verifying_drafts_is_staged_one_row_per_verified_token(
    seed: int, block_size: int
) -> None:
    """Staged as `prepare_inputs` lays it out: a verifying row's last token and drafts are
    one-token rows at consecutive positions, each with one more key than the one before, and
    every one of them gives logits."""
    rng = random.Random(seed)
    driver = DraftDriver(rng, block_size, 5)
    stager = InputStager(block_size, 4, NUM_BLOCKS, CPU, token_capacity=8, max_num_seqs=2)
    verified = 0
    for batch in driver.batches(40):
        rows = [i for i in range(len(batch.seqs)) if batch.samples_after(i)]
        staged = stager.stage(batch, rows)
        assert_same_input(staged, batch, block_size)
        layout, ids = staged.model_input.layout, staged.model_input.input_ids.tolist()
        widths = [1 + len(batch.draft_token_ids.get(i, [])) for i in range(len(batch.seqs))]
        firsts = [sum(widths[:i]) for i in range(len(batch.seqs))]
        for i, drafts in batch.draft_token_ids.items():
            verified += 1
            seq, start = batch.seqs[i], batch.seqs[i].num_computed_tokens
            mine = range(firsts[i], firsts[i] + 1 + len(drafts))
            assert [layout.seqlens_q[r] for r in mine] == [1] * len(mine)
            assert [layout.seqlens_k[r] for r in mine] == list(
                range(start + 1, start + 1 + len(mine))
            )
            assert [ids[layout.query_starts[r]] for r in mine] == [
                seq.output_token_ids[-1],
                *drafts,
            ]
        assert staged.logits_indices is not None
        want = [firsts[i] + j for i in rows for j in range(widths[i])]
        assert staged.logits_indices.tolist() == want
        driver.update(batch)
    assert verified
