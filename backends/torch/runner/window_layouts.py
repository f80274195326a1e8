"""A step's layouts in the window groups of a KV cache with groups (kv_cache.py's `KVGroups`).

Each window group has its own block tables (`Sequence.window_tables`, the block manager's):
the same step then writes and reads other blocks there, so it gets its own `block_tables` and
`slot_mapping`; the token rows, context lengths and decode rows are the main layout's. A
block a window table dropped (`NO_BLOCK`) reads as block 0, as the padding does: it lies
wholly before the window of every token of the step, so it is never attended to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
import torch

from backends.torch.attention.base import BatchLayout
from schedulers.sequence import Sequence


def window_layouts(
    layout: BatchLayout,
    seqs: Seq[Sequence],
    context_blocks: np.ndarray,
    seq_of_token: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    pad_block: int,
) -> tuple[BatchLayout, ...]:
    """`layout` in each window group of `seqs`' tables (() when they have none).

    `context_blocks[r]`: the blocks row r's context spans (its table's entries past them read
    as block 0); `seq_of_token` and `positions`: each token row's sequence row and position;
    rows past `seqs` (a padded batch) read `pad_block`.
    """
    num_groups = len(seqs[0].window_tables) if seqs else 0
    if not num_groups:
        return ()
    num_rows, width = layout.block_tables.shape
    device = layout.block_tables.device
    out = []
    for group in range(num_groups):
        tables = np.zeros((num_rows, width), np.int64)
        for row, seq in enumerate(seqs):
            entries = seq.window_tables[group][: int(context_blocks[row])]
            tables[row, : len(entries)] = entries
        tables[tables < 0] = 0  # NO_BLOCK: dropped out of the window, never read
        tables[len(seqs) :] = pad_block
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        out.append(
            dataclasses.replace(
                layout,
                block_tables=torch.from_numpy(tables).to(device),
                slot_mapping=torch.from_numpy(slots).to(device),
                groups=(),
            )
        )
    return tuple(out)
