"""One step's model inputs, staged in persistent buffers and sent to the device in one copy.

`prepare_inputs` (inputs.py) builds each step's arrays as fresh tensors, one host-to-device
copy each, from pageable memory: eight synchronising copies a step on a GPU. `InputStager`
packs the same arrays into one int64 host buffer (pinned where CUDA is present, two of them
used in turn, so filling the next step's never waits for the copy of this one), fills it
with numpy (no Python loop over tokens or blocks), and sends it in one non-blocking copy into
one persistent device buffer, sliced into `cu_seqlens_q`, `seq_lens`, `logits_indices`,
`decode_indices`, `block_tables`, `input_ids`, `positions` and `slot_mapping`. On the CPU the
"device" buffer is the host buffer itself: nothing is copied.

Block tables persist: each sequence has a row of a host table that grows in place, so a
step writes only the blocks appended since the last one (and the blocks the block manager
may have swapped for cached ones, which are only blocks the sequence's previous step filled:
block_manager.cache_full_blocks). A table list replaced by the block manager (free on
preemption, a prefix hit) is written again whole.

Padding (`pad_to`, for CUDA graphs): rows past the batch are one-token sequences whose only
slot is in the scratch KV block, which no sequence owns, so their K/V writes land nowhere
that matters and their attention reads one valid slot.

NOTE: the tensors of a step are views of the persistent buffers; they are valid until the
step after next (CPU) or the next step (a device buffer).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.torch.attention.base import BatchLayout
from backends.torch.runner.inputs import ModelInput
from backends.torch.runner.verify_rows import verify_rows
from backends.torch.runner.window_layouts import window_layouts
from schedulers import defaults
from schedulers.batch import Batch
from schedulers.sequence import Sequence

#: token rows the buffers are first sized for (they grow when a step needs more)
DEFAULT_TOKEN_CAPACITY = 4096


@dataclass
class _TableRow:
    """A sequence's row in the persistent block table."""

    index: int  # row of the host table
    source: list[int]  # the block-table list it mirrors (a new list means rewrite it all)
    rewrite_from: int  # first column that may differ from `source` (see the module docstring)


@dataclass(frozen=True)
class StagedInput:
    """One step's staged model input and what the runner needs beside it."""

    model_input: ModelInput
    logits_indices: torch.Tensor | None  # (R,) sequence indices sampled from; None: all rows
    num_seqs: int  # real sequences; rows past it are padding


class InputStager:
    """Persistent host and device buffers for one backend's step inputs (module docstring)."""

    def __init__(
        self,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        device: torch.device,
        token_capacity: int = DEFAULT_TOKEN_CAPACITY,
        max_num_seqs: int = defaults.MAX_NUM_SEQS,
        *,
        static_device_buffer: bool | None = None,
    ) -> None:
        """`static_device_buffer`: a device buffer apart from the host ones even on the CPU,
        whose addresses never change between steps of one shape (what a CUDA graph reads;
        None: only off the CPU)."""
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self.static_device_buffer = (
            self.device.type != "cpu" if static_device_buffer is None else static_device_buffer
        )
        #: bumped whenever the device buffer is reallocated (CUDA graphs read its addresses)
        self.generation = 0
        self._table = np.zeros((max(max_num_seqs, 1), max(max_blocks_per_seq, 1)), np.int64)
        self._rows: dict[int, _TableRow] = {}
        self._free_rows = list(range(self._table.shape[0] - 1, -1, -1))
        self._turn = 0
        self._allocate(self._words(max_num_seqs, max_blocks_per_seq, token_capacity))

    # -- buffers ---------------------------------------------------------------------------

    @staticmethod
    def _words(num_seqs: int, width: int, num_tokens: int, num_logits: int | None = None) -> int:
        """int64 words a step of this shape packs (see `stage`)."""
        logits = num_seqs if num_logits is None else num_logits
        return (num_seqs + 1) + num_seqs + logits + num_seqs + num_seqs * width + 3 * num_tokens

    def _allocate(self, words: int) -> None:
        self.capacity = words
        self._host = [
            torch.zeros(words, dtype=torch.int64, pin_memory=self.pinned) for _ in range(2)
        ]
        self._host_np = [buffer.numpy() for buffer in self._host]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        if not self.static_device_buffer:
            self._device: torch.Tensor | None = None
        else:
            self._device = torch.zeros(words, dtype=torch.int64, device=self.device)
        self.generation += 1

    # -- block tables ----------------------------------------------------------------------

    def release(self, seq_id: int) -> None:
        """Free a finished sequence's block-table row."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row.index)

    def _row_of(self, seq: Sequence) -> int:
        """`seq`'s host table row, brought up to date with its block table."""
        table = seq.block_table
        row = self._rows.get(seq.seq_id)
        if row is None:
            if not self._free_rows:
                self._grow_table(rows=2 * self._table.shape[0])
            row = _TableRow(self._free_rows.pop(), table, 0)
            self._rows[seq.seq_id] = row
        elif row.source is not table:
            row.source, row.rewrite_from = table, 0
        if len(table) > self._table.shape[1]:
            self._grow_table(cols=len(table))
        start = min(row.rewrite_from, len(table))
        self._table[row.index, start : len(table)] = table[start:]
        # NOTE: the block manager swaps only blocks this step fills for cached copies, so the
        # next step rewrites from the block this step starts in
        row.rewrite_from = seq.num_computed_tokens // self.block_size
        return row.index

    def _grow_table(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self._table.shape
        new = np.zeros((rows or old_rows, max(cols or old_cols, old_cols)), np.int64)
        new[:old_rows, :old_cols] = self._table
        self._table = new
        self._free_rows[:0] = range(new.shape[0] - 1, old_rows - 1, -1)

    # -- one step --------------------------------------------------------------------------

    def stage(
        self,
        batch: Batch,
        rows: list[int] | None = None,
        *,
        pad_to: int | None = None,
        full_width: bool = False,
    ) -> StagedInput:
        """`batch`'s inputs on the device, equal to `prepare_inputs(batch, ...)`'s.

        `rows`: the sequences sampled from (None: all). `pad_to`: rows to pad the batch to with
        scratch sequences (CUDA graphs; every row then gives logits). `full_width`: block
        tables `max_blocks_per_seq` wide (a CUDA graph's fixed shape) instead of the batch's
        widest. A batch that verifies drafts is staged as `verify_rows` lays it out (a row
        per verified token; logits at every position of the rows sampled from).
        """
        if batch.num_draft_tokens:
            flat = verify_rows(batch, rows)
            seqs, scheduled, rows = flat.seqs, flat.num_scheduled_tokens, flat.logits_rows
            starts = np.asarray(flat.starts, np.int64)
            chunks: Iterable[list[int]] = flat.token_ids
        else:
            seqs, scheduled = batch.seqs, batch.num_scheduled_tokens
            starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
            chunks = (
                s.token_ids(a, a + n)
                for s, a, n in zip(seqs, starts.tolist(), scheduled, strict=True)
            )
        bs = self.block_size
        num_seqs = len(seqs)
        num_rows = num_seqs if pad_to is None else max(pad_to, num_seqs)
        q_lens = np.ones(num_rows, np.int64)
        q_lens[:num_seqs] = scheduled
        ctx_lens = q_lens.copy()
        ctx_lens[:num_seqs] += starts
        num_tokens = int(q_lens.sum())
        blocks = -(-ctx_lens // bs)  # (B,) blocks each context spans
        table_rows = np.fromiter((self._row_of(s) for s in seqs), np.int64, num_seqs)
        width = self.max_blocks_per_seq if full_width else int(blocks.max())
        width = max(width, int(blocks.max()))
        if width > self._table.shape[1]:
            self._grow_table(cols=width)
        logits = None if rows is None or pad_to is not None else np.asarray(rows, np.int64)
        num_logits = num_rows if logits is None else len(logits)
        words = self._words(num_rows, width, num_tokens, num_logits)
        if words > self.capacity:
            self._allocate(max(words, 2 * self.capacity))
        turn = self._turn
        self._turn ^= 1
        event = self._copied[turn]
        if event is not None:
            event.synchronize()  # that buffer's copy, issued two steps ago, must be done
        host = self._host_np[turn]
        views = _Views(host, num_rows, num_logits, width, num_tokens)
        cu = views.cu_seqlens_q
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:])
        views.seq_lens[:] = ctx_lens
        views.logits_indices[:] = np.arange(num_rows) if logits is None else logits
        is_decode = q_lens == 1
        decodes = np.flatnonzero(is_decode)
        views.decode_indices[: len(decodes)] = decodes
        tables = views.block_tables
        tables[:num_seqs] = self._table[table_rows, :width]
        tables[:num_seqs][np.arange(width)[None, :] >= blocks[:num_seqs, None]] = 0
        tables[num_seqs:] = self.scratch_block
        real_tokens = int(cu[num_seqs])
        views.input_ids[:real_tokens] = np.fromiter(
            itertools.chain.from_iterable(chunks), np.int64, real_tokens
        )
        views.input_ids[real_tokens:] = 0
        seq_of_token = np.repeat(np.arange(num_rows), q_lens)
        offsets = ctx_lens - q_lens - cu[:-1]  # position minus flat row, per sequence
        positions = views.positions
        np.add(np.arange(num_tokens), offsets[seq_of_token], out=positions)
        views.slot_mapping[:] = tables[seq_of_token, positions // bs] * bs + positions % bs
        device_words = self._send(turn, words)
        on = _Views(device_words, num_rows, num_logits, width, num_tokens)
        q_list, k_list = q_lens.tolist(), ctx_lens.tolist()
        decode_list = decodes.tolist()
        layout = BatchLayout(
            cu_seqlens_q=on.cu_seqlens_q,
            context_lens=on.seq_lens,
            slot_mapping=on.slot_mapping,
            block_tables=on.block_tables.view(num_rows, width),
            query_starts=tuple(cu[:-1].tolist()),
            seqlens_q=tuple(q_list),
            seqlens_k=tuple(k_list),
            decode_indices=on.decode_indices[: len(decode_list)],
            decode_max_blocks=(
                width
                if full_width and decode_list
                else max((int(blocks[i]) for i in decode_list), default=0)
            ),
            prefill_indices=tuple(i for i, n in enumerate(q_list) if n > 1),
        )
        groups = window_layouts(
            layout, seqs, blocks, seq_of_token, positions, bs, self.scratch_block
        )
        if groups:
            layout = dataclasses.replace(layout, groups=groups)
        return StagedInput(
            ModelInput(on.input_ids, on.positions, layout),
            None if logits is None else on.logits_indices,
            num_seqs,
        )

    def _send(self, turn: int, words: int) -> torch.Tensor:
        """The first `words` of host buffer `turn` on the device: one non-blocking copy."""
        host = self._host[turn][:words]
        if self._device is None:
            return host
        device = self._device[:words]
        device.copy_(host, non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._copied[turn] = event
        return device


class _Views:
    """The named slices of one packed step buffer (host numpy array or device tensor)."""

    # NOTE: Any: the same slicing serves numpy (host fill) and torch (the step's tensors)
    cu_seqlens_q: Any
    seq_lens: Any
    logits_indices: Any
    decode_indices: Any
    input_ids: Any
    positions: Any
    slot_mapping: Any
    block_tables: Any

    def __init__(self, words: Any, rows: int, logits: int, width: int, tokens: int) -> None:
        sizes = [rows + 1, rows, logits, rows, rows * width, tokens, tokens, tokens]
        bounds = list(itertools.accumulate(sizes, initial=0))
        parts = [words[a:b] for a, b in itertools.pairwise(bounds)]
        (
            self.cu_seqlens_q, self.seq_lens, self.logits_indices, self.decode_indices,
            flat_tables, self.input_ids, self.positions, self.slot_mapping,
        ) = parts  # fmt: skip
        self.block_tables = flat_tables.reshape(rows, width) if rows * width else flat_tables
