"""One iteration's flat model inputs: every scheduled token of every sequence, concatenated."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from backends.torch.attention.base import BatchLayout
from backends.torch.runner.verify_rows import verify_rows
from backends.torch.runner.window_layouts import window_layouts
from schedulers.batch import Batch
from schedulers.block_manager import blocks_for


@dataclass(frozen=True)
class ModelInput:
    """Token ids and positions of the flat batch, and where its tokens sit in the KV cache."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    layout: BatchLayout


def prepare_inputs(batch: Batch, block_size: int, device: torch.device) -> ModelInput:
    """Flatten `batch` into token ids, positions and attention layout on `device` (a batch
    that verifies drafts as `verify_rows` lays it out: one row per verified token)."""
    seqs = batch.seqs
    if batch.num_draft_tokens:
        flat = verify_rows(batch)
        seqs, starts, q_lens = flat.seqs, flat.starts, flat.num_scheduled_tokens
        token_ids = list(itertools.chain.from_iterable(flat.token_ids))
    else:
        starts = [seq.num_computed_tokens for seq in seqs]
        q_lens = batch.num_scheduled_tokens
        token_ids = list(
            itertools.chain.from_iterable(
                seq.token_ids(s, s + n) for seq, s, n in zip(seqs, starts, q_lens, strict=True)
            )
        )
    ctx_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
    bs = block_size
    widths = [blocks_for(c, bs) for c in ctx_lens]
    width = max(widths)
    tables = [seq.block_table[:w] + [0] * (width - w) for seq, w in zip(seqs, widths, strict=True)]
    cu_seqlens_q = torch.tensor(list(itertools.accumulate(q_lens, initial=0)))  # (B + 1,)
    block_tables = torch.tensor(tables)  # (B, width)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))  # (N,)
    offsets = torch.tensor(starts) - cu_seqlens_q[:-1]  # (B,) position minus flat row
    positions = torch.arange(len(token_ids)) + offsets[seq_of_token]  # (N,)
    slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
    layout = build_layout(
        cu_seqlens_q, torch.tensor(ctx_lens), slot_mapping, block_tables, block_size, device
    )
    groups = window_layouts(
        layout, seqs, np.asarray(widths), seq_of_token.numpy(), positions.numpy(), bs, 0
    )
    if groups:
        layout = dataclasses.replace(layout, groups=groups)
    return ModelInput(
        input_ids=torch.tensor(token_ids, device=device),
        positions=positions.to(device),
        layout=layout,
    )


def build_layout(
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> BatchLayout:
    """The `BatchLayout` of one step from its flat host int64 arrays, on `device`.

    The one place a layout is built: `prepare_inputs` and tensor parallelism's ranks, which
    rebuild it from the broadcast arrays (parallel/step.py), both call it.
    """
    cu = cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    ctx_lens = context_lens.tolist()
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    return BatchLayout(
        cu_seqlens_q=cu_seqlens_q.to(device),
        context_lens=context_lens.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        query_starts=tuple(cu[:-1]),
        seqlens_q=tuple(q_lens),
        seqlens_k=tuple(ctx_lens),
        decode_indices=torch.tensor(decodes, dtype=torch.long, device=device),
        decode_max_blocks=max((blocks_for(ctx_lens[i], block_size) for i in decodes), default=0),
        prefill_indices=tuple(i for i, n in enumerate(q_lens) if n > 1),
    )


def warm_up_layout(num_tokens: int, block_size: int, device: torch.device) -> BatchLayout:
    """One fresh sequence of `num_tokens` tokens in blocks 0, 1, ...: a compiler warm-up.

    NOTE: only before the first request: its K/V land in blocks nobody holds yet, and every
    slot is written before it is ever read.
    """
    num_blocks = blocks_for(num_tokens, block_size)
    return build_layout(
        torch.tensor([0, num_tokens]), torch.tensor([num_tokens]), torch.arange(num_tokens),
        torch.arange(num_blocks)[None], block_size, device,
    )  # fmt: skip
