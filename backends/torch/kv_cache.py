"""Paged KV tensors: per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim].

Sizing (first rule that applies):

1. `kv_cache_gb` given: that many GiB.
2. on CUDA: `kv_cache_fraction` (default 0.85) of the free device memory after the weights.
3. on CPU: `DEFAULT_CPU_KV_GB` (1 GiB).

Whatever the budget, the cache never holds more than `max_num_seqs` full-length sequences
(`max_model_len` tokens each), so small models on CPU do not reserve memory they cannot use.

KV cache groups (`KVGroups`, vLLM's hybrid KV cache manager): where some layers attend to
everything and at least as many to a sliding window (Gemma 2 and 3), the layers are split into
groups of as many layers as attend to everything, one group of those and the sliding ones in
groups of the same size (the last padded). A block then holds one group's layers: layer j of
every group shares slot j's tensors, and the block manager hands each block to one group, so
a sliding group's table keeps only its window's blocks (schedulers/block_manager.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schedulers.block_manager import blocks_for

DEFAULT_CPU_KV_GB = 1.0
DEFAULT_CUDA_KV_FRACTION = 0.85
GIB = 1024**3


@dataclass(frozen=True)
class KVGroups:
    """Which layers share a block table: group 0 attends to everything, the others each to
    their sliding window (module docstring)."""

    layers: tuple[tuple[int, ...], ...]  # each group's layers, in cache order
    windows: tuple[int | None, ...]  # each group's window; None (group 0): everything

    @property
    def size(self) -> int:
        """Layers one block holds: the slots every group's layers share."""
        return max(len(layers) for layers in self.layers)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The window groups' windows, in order (the block manager's `windows`)."""
        return tuple(w for w in self.windows if w is not None)

    def group_of(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.layers) if layer in layers)

    def slot_of(self, layer: int) -> int:
        return self.layers[self.group_of(layer)].index(layer)


def kv_groups(windows: Sequence[int | None]) -> KVGroups | None:
    """The KV cache groups of layers with these sliding windows (None: full attention); None
    where one group serves best: no layer or every layer slides, or fewer slide than not."""
    full = tuple(i for i, w in enumerate(windows) if w is None)
    sliding: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            sliding.setdefault(w, []).append(i)
    num_sliding = len(windows) - len(full)
    if not full or num_sliding < len(full):
        return None
    layers: list[tuple[int, ...]] = [full]
    group_windows: list[int | None] = [None]
    for window, members in sliding.items():
        for start in range(0, len(members), len(full)):
            layers.append(tuple(members[start : start + len(full)]))
            group_windows.append(window)
    return KVGroups(tuple(layers), tuple(group_windows))


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache (everything but the number of blocks)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    groups: KVGroups | None = None  # None: one group, a block holds every layer

    @property
    def num_slots(self) -> int:
        """Layers one block holds (its group's, or every layer)."""
        return self.num_layers if self.groups is None else self.groups.size

    @property
    def num_groups(self) -> int:
        return 1 if self.groups is None else len(self.groups.layers)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block's layers for `block_size` token slots."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_slots * self.block_size * self.num_kv_heads * self.head_dim * elem


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
    per_seq = blocks_for(max_model_len, layout.block_size) * layout.num_groups
    fit = budget_bytes // layout.bytes_per_block
    if fit < per_seq:
        size, groups = layout.block_size, layout.num_groups
        raise ValueError(
            f"the KV cache cannot hold one {max_model_len}-token sequence (max_model_len): "
            f"its budget of {_size(budget_bytes)} holds {fit} blocks of {size} tokens "
            f"({fit * size // groups} tokens), one sequence needs {per_seq} blocks "
            f"({per_seq * size // groups} tokens, {_size(per_seq * layout.bytes_per_block)}); "
            "raise "
            "kv_cache_gb (kv_cache_fraction on CUDA) or lower max_model_len"
        )
    return min(fit, per_seq * max_num_seqs)


def _size(nbytes: int) -> str:
    """`nbytes` in GiB, or in MiB below 1 GiB (a refusal's budget may be a few MiB)."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


class KVCache:
    """Zero-initialised paged K and V tensors, one pair per layer (with KV cache groups, one
    pair per slot: `k[layer]` is its slot's tensor, shared with the other groups' layers).

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
        slots = range(layout.num_slots)
        k = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in slots]
        v = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in slots]
        groups = layout.groups
        if groups is None:
            self.k, self.v = k, v
        else:
            self.k = [k[groups.slot_of(i)] for i in range(layout.num_layers)]
            self.v = [v[groups.slot_of(i)] for i in range(layout.num_layers)]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block
