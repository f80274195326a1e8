"""Paged KV tensors: per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim].

Sizing (first rule that applies):

1. `kv_cache_gb` given: that many GiB.
2. on CUDA: `kv_cache_fraction` (default 0.85) of the free device memory after the weights.
3. on CPU: `DEFAULT_CPU_KV_GB` (1 GiB).

Whatever the budget, the cache never holds more than `max_num_seqs` full-length sequences
(`max_model_len` tokens each), so small models on CPU do not reserve memory they cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schedulers.block_manager import blocks_for

DEFAULT_CPU_KV_GB = 1.0
DEFAULT_CUDA_KV_FRACTION = 0.85
GIB = 1024**3


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache (everything but the number of blocks)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block of `block_size` token slots."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def kv_budget_bytes(
    device: torch.device, kv_cache_gb: float | None, kv_cache_fraction: float | None
) -> int:
    """Bytes the KV cache may take on `device` (see the module docstring)."""
    if kv_cache_gb is not None:
        if kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {kv_cache_gb}")
        return int(kv_cache_gb * GIB)
    if device.type == "cuda":
        fraction = DEFAULT_CUDA_KV_FRACTION if kv_cache_fraction is None else kv_cache_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction}")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(DEFAULT_CPU_KV_GB * GIB)


def plan_num_blocks(
    layout: KVLayout, budget_bytes: int, max_model_len: int, max_num_seqs: int
) -> int:
    """Blocks that fit in `budget_bytes`, capped at `max_num_seqs` full-length sequences."""
    fit = budget_bytes // layout.bytes_per_block
    cap = blocks_for(max_model_len, layout.block_size) * max_num_seqs
    num_blocks = min(fit, cap)
    if num_blocks < blocks_for(max_model_len, layout.block_size):
        need_gb = blocks_for(max_model_len, layout.block_size) * layout.bytes_per_block / GIB
        raise ValueError(
            f"KV budget of {budget_bytes / GIB:.3f} GiB holds {num_blocks} blocks, fewer than one "
            f"{max_model_len}-token sequence needs ({need_gb:.3f} GiB); raise kv_cache_gb or "
            "lower max_model_len"
        )
    return num_blocks


class KVCache:
    """Zero-initialised paged K and V tensors, one pair per layer.

    NOTE: zeros, not empty: batched decode reads whole blocks and masks the unused slots,
    and a NaN left in memory would survive a zero attention weight.
    NOTE: one block more than `num_blocks` is allocated: `scratch_block`, which the block
    manager never hands out, so the padded rows of a CUDA graph's batch (staging.py) have a
    slot to write their K/V to and to read from that no sequence owns.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block
