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
    """Blocks that fit in `budget_bytes`, capped at `max_num_seqs` full-length sequences.

    A budget that cannot hold one `max_model_len`-token sequence is refused, naming what it
    holds and what one sequence needs (`carousel serve` logs it as `arm_load_failed`).
    """
    per_seq = blocks_for(max_model_len, layout.block_size)
    fit = budget_bytes // layout.bytes_per_block
    if fit < per_seq:
        size = layout.block_size
        raise ValueError(
            f"the KV cache cannot hold one {max_model_len}-token sequence (max_model_len): "
            f"its budget of {_size(budget_bytes)} holds {fit} blocks of {size} tokens "
            f"({fit * size} tokens), one sequence needs {per_seq} blocks "
            f"({per_seq * size} tokens, {_size(per_seq * layout.bytes_per_block)}); raise "
            "kv_cache_gb (kv_cache_fraction on CUDA) or lower max_model_len"
        )
    return min(fit, per_seq * max_num_seqs)


def _size(nbytes: int) -> str:
    """`nbytes` in GiB, or in MiB below 1 GiB (a refusal's budget may be a few MiB)."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


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
