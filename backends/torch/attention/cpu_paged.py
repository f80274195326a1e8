"""Decodes through Carousel's own CPU kernel, reading K/V in place from the paged cache.

Prefills run as in `sdpa` (one SDPA call per sequence). Decodes (one new token each) go to
`kernels.native().decode_attention`: one task per sequence (per (sequence, K/V head)
when there are too few sequences for the threads) walks the sequence's block table in
groups of 16 keys, one K/V head at a time: the 16 scores of each query head come out of one
transposing sum, and the values are summed into accumulators held in registers, in fp32.
Nothing is gathered out of the cache and no padding mask is built, so a decode costs what
its own context costs, not the widest block table's (sdpa's gather plus masked SDPA took
about 600 us per layer at B = 64 on the 2-core CPU; docs/benchmarks/history/).

Runs on CPUs with AVX-512 and BF16 where the kernels build (cpu_kernels); fp32 and bf16;
heads up to 256 wide (`auto` takes `sdpa` for wider ones).

`per_token` (the `batch_invariant` mode): every token, a prompt's too, goes to the decode
kernel as a decode over its own context (its block table, its position + 1 keys), after the
step's K/V are written. A token's attention is then the same sums in the same order whether
its prompt came whole, in chunks, after a cached prefix, as a recompute, or as a decode, beside
any other sequences: the kernel splits work by sequence and K/V head only, never along keys.
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
from backends.torch.attention.sdpa import prefill_all, prefill_masks
from backends.torch.kv_cache import KVCache


@dataclass(frozen=True)
class CpuPagedMetadata(AttentionMetadata):
    decode_rows: torch.Tensor  # (D,) the decode tokens' flat rows
    all_decodes: bool  # every scheduled token is a decode, in row order
    block_tables: torch.Tensor  # (D, nb) contiguous, the decodes' block tables
    context_lens: torch.Tensor  # (D,) contiguous
    prefill_masks: dict[int | None, list[torch.Tensor | None]]


class CpuPagedBackend(AttentionBackend[CpuPagedMetadata]):
    """Paged attention with decodes in Carousel's CPU kernel (see the module docstring)."""

    name = "cpu_paged"
    devices = ("cpu",)
    native_decodes = True
    token_by_token = True

    @classmethod
    def why_not_here(
        cls, device: torch.device, dtype: torch.dtype | None, head_dim: int
    ) -> str | None:
        if kernels.native() is None:
            return f"needs Carousel's CPU kernels: {kernels.why_off()}"
        if dtype is not None and not kernels.computes(dtype):
            return f"runs float32 and bfloat16, not {dtype}"
        if head_dim > kernels.max_head_dim():
            return f"supports head sizes up to {kernels.max_head_dim()}, not {head_dim}"
        return None

    @classmethod
    def preferred_on(cls, device: torch.device, dtype: torch.dtype | None) -> bool:
        return device.type == "cpu" and kernels.computes(dtype)  # bare decode step: -25%

    def __init__(
        self, kv_cache: KVCache, layers: Sequence[AttentionSpec], *, per_token: bool = False
    ) -> None:
        super().__init__(kv_cache, layers)
        self.per_token = per_token
        native = kernels.native()
        if native is None:
            raise RuntimeError(f"cpu_paged needs Carousel's CPU kernels: {kernels.why_off()}")
        dtype = kv_cache.k[0].dtype
        if not kernels.computes(dtype):
            raise ValueError(f"cpu_paged runs float32 and bfloat16, not {dtype}")
        self.kernel = native.decode_attention
        self.windows = sorted({spec.sliding_window for spec in layers}, key=str)

    def build_metadata(self, layout: BatchLayout) -> CpuPagedMetadata:
        if self.per_token:
            return _every_token_a_decode(layout)
        dec = layout.decode_indices
        num = dec.shape[0]
        return CpuPagedMetadata(
            layout=layout,
            decode_rows=layout.cu_seqlens_q[dec],
            all_decodes=num == layout.num_tokens,
            block_tables=layout.block_tables[dec, : layout.decode_max_blocks].contiguous(),
            context_lens=layout.context_lens[dec].contiguous(),
            prefill_masks={w: prefill_masks(layout, w) for w in self.windows},
        )

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CpuPagedMetadata
    ) -> torch.Tensor:
        spec = self.layers[layer]
        window = -1 if spec.sliding_window is None else spec.sliding_window
        if meta.all_decodes:  # a pure decode step: rows are the decodes, in order
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            heads_contiguous = q.stride(2) == 1 and q.stride(1) == q.shape[2]
            self._decode(layer, q if heads_contiguous else q.contiguous(), meta, window, out)
            return out
        out = q.new_empty(q.shape)  # (N, nh, hd)
        prefill_all(self, layer, q, k, v, meta.layout, meta.prefill_masks[spec.sliding_window], out)
        rows = meta.decode_rows
        if rows.numel():
            dec_out = q.new_empty((rows.shape[0], *q.shape[1:]))
            self._decode(layer, q[rows].contiguous(), meta, window, dec_out)
            out[rows] = dec_out
        return out

    def _decode(
        self, layer: int, q: torch.Tensor, meta: CpuPagedMetadata, window: int, out: torch.Tensor
    ) -> None:
        self.kernel(
            q, self.kv_cache.k[layer], self.kv_cache.v[layer], meta.block_tables,
            meta.context_lens, self.layers[layer].scale, window, out,
        )  # fmt: skip


def _every_token_a_decode(layout: BatchLayout) -> CpuPagedMetadata:
    """Metadata that sends every scheduled token to the decode kernel (`per_token`)."""
    device = layout.slot_mapping.device
    n = layout.num_tokens
    seqlens_q = torch.tensor(layout.seqlens_q, device=device)
    seq = torch.repeat_interleave(torch.arange(layout.num_seqs, device=device), seqlens_q)  # (N,)
    # a token's keys: its sequence's context less the tokens scheduled after it
    after = layout.cu_seqlens_q[seq + 1] - 1 - torch.arange(n, device=device)  # (N,)
    return CpuPagedMetadata(
        layout=layout,
        decode_rows=torch.arange(n, device=device),
        all_decodes=True,
        block_tables=layout.block_tables[seq].contiguous(),  # (N, max_blocks)
        context_lens=(layout.context_lens[seq] - after).contiguous(),
        prefill_masks={},
    )
