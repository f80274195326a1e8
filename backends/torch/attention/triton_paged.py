"""Paged attention in Triton: one K/V store kernel, one attention kernel for the whole step.

`write_kv` stores the step's K/V at `slot_mapping` (triton_kernels/kv_store.py); `attend`
runs prefills, prefill chunks over a cached context and decodes in one launch over the block
tables (triton_kernels/unified_attention.py): varlen queries from `cu_seqlens_q`, the query
heads of a K/V head packed into one program's rows, causal and sliding-window masks from
positions, K/V read in place. Nothing is gathered, padded or masked by a tensor, and building
the metadata reads only host copies, so a step launches without a device sync.

The CUDA default (`auto`). On the CPU it runs only in Triton's interpreter
(`TRITON_INTERPRET=1`): slow, for tests of the kernels' logic against a reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.torch import kernels
from backends.torch.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    BatchLayout,
)
from backends.torch.kv_cache import KVCache

#: cache dtypes the kernels are tested in
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TritonPagedMetadata(AttentionMetadata):
    max_query_len: int  # the most new tokens of one sequence (host int: picks the block size)


class TritonPagedBackend(AttentionBackend[TritonPagedMetadata]):
    """Paged attention through Carousel's Triton kernels (see the module docstring)."""

    name = "triton_paged"
    devices = ("cuda", "cpu")
    shared_kv_write = False  # its own `write_kv`: the kv_store kernel

    @classmethod
    def why_not_here(
        cls, device: torch.device, dtype: torch.dtype | None, head_dim: int
    ) -> str | None:
        why_no_triton = kernels.triton_why_off(device.type)
        if why_no_triton is not None:
            return f"cannot run here: {why_no_triton}"
        if dtype is not None and dtype not in DTYPES:
            return f"runs float32, bfloat16 and float16, not {dtype}"
        return None

    @classmethod
    def preferred_on(cls, device: torch.device, dtype: torch.dtype | None) -> bool:
        return device.type == "cuda" and dtype in DTYPES  # on the CPU: the interpreter only

    def __init__(self, kv_cache: KVCache, layers: Sequence[AttentionSpec]) -> None:
        super().__init__(kv_cache, layers)
        dtype = kv_cache.k[0].dtype
        if dtype not in DTYPES:
            raise ValueError(f"triton_paged runs float32, bfloat16 and float16, not {dtype}")
        self.ops = kernels.triton(kv_cache.k[0].device.type)

    def build_metadata(self, layout: BatchLayout) -> TritonPagedMetadata:
        return TritonPagedMetadata(layout=layout, max_query_len=max(layout.seqlens_q, default=0))

    def write_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: TritonPagedMetadata
    ) -> None:
        self.ops.store_kv(
            k, v, self.kv_cache.k[layer], self.kv_cache.v[layer], meta.layout.slot_mapping
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TritonPagedMetadata,
    ) -> torch.Tensor:
        spec, layout = self.layers[layer], meta.layout
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (N, nh, hd)
        self.ops.paged_attention(
            out, q, self.kv_cache.k[layer], self.kv_cache.v[layer], layout.block_tables,
            layout.context_lens, layout.cu_seqlens_q, spec.scale, spec.sliding_window,
            meta.max_query_len,
        )  # fmt: skip
        return out
