"""Decode attention that reads K/V in place from the paged cache: one Inductor-compiled kernel.

The reference backend gathers every decoding sequence's K/V out of the cache into a dense
`(D, nkv, S, hd)` copy in every layer, then runs SDPA over it with a padding mask. Here
`paged_decode` is written with the block-table lookup inside the attention math, and
torch.compile (Inductor's CPU C++ code generation) turns it into one fused C++ kernel per
call: scores, masked softmax and the weighted sum of V, loading each key and value straight
from its cache slot (an indirect load), with no gathered copy and no mask tensor.

Scores and softmax are computed in fp32 whatever the cache dtype, like SDPA's CPU kernels.
Prefills run through SDPA exactly as in the reference backend (a prefill is a real matmul
that SDPA's flash kernel does well), and so do steps with fewer than `MIN_PAGED_DECODES`
decodes, where the gather is cheaper than the compiled call. The kernel is compiled once per
process at start-up (`warm_up`) for dynamic sizes (backends/torch/stacks/inductor.py), so no
request
ever waits for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.torch.attention.base import AttentionSpec, BatchLayout
from backends.torch.attention.sdpa import SDPABackend, SDPAMetadata, prefill_all, prefill_masks
from backends.torch.kv_cache import KVCache
from backends.torch.stacks import inductor


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of D one-token queries over their paged contexts, read in place.

    `q` (D, nh, hd); caches (num_blocks, bs, nkv, hd); `block_tables` (D, W) with the first
    `context_lens[d]` slots of row d valid. Returns (D, nh, hd) in `q`'s dtype.
    """
    num_seqs, width = block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    pos = torch.arange(width * block_size, device=q.device)  # (S,) logical key positions
    blocks = block_tables[:, pos // block_size]  # (D, S) physical block of each key
    keys = k_cache[blocks, pos % block_size]  # (D, S, nkv, hd): an indirect load, never copied
    values = v_cache[blocks, pos % block_size]
    queries = q.view(num_seqs, 1, num_kv_heads, group, head_dim).float()  # (D, 1, nkv, g, hd)
    scores = (queries * keys[:, :, :, None, :].float()).sum(-1) * scale  # (D, S, nkv, g)
    last = context_lens[:, None] - 1  # (D, 1) the query's own position
    allowed = pos[None, :] <= last  # (D, S)
    if window is not None:
        allowed &= pos[None, :] > last - window
    scores = scores.masked_fill(~allowed[:, :, None, None], -math.inf)
    probs = scores.softmax(dim=1)  # over the keys
    out = (probs[..., None] * values[:, :, :, None, :].float()).sum(1)  # (D, nkv, g, hd)
    return out.reshape(num_seqs, -1, head_dim).to(q.dtype)  # (D, nh, hd)


# NOTE: only the dims marked in `_decode` are dynamic; head counts and sizes are constants
_paged_decode = torch.compile(paged_decode, fullgraph=True)


#: fewer decodes than this run the reference gather + SDPA path: the compiled kernel's fixed
#: call cost (about 20 us more per layer) outweighs the gather it saves (measured, 2 cores:
#: D = 1 37 vs 21 us, D = 8 73 vs 68 us, D = 64 315 vs 380-1400 us per layer)
MIN_PAGED_DECODES = 16


@dataclass(frozen=True)
class PagedMetadata(SDPAMetadata):
    """SDPA's metadata, plus the decodes' block tables when the compiled kernel runs them."""

    decode_block_tables: torch.Tensor | None  # (D, nb)
    decode_context_lens: torch.Tensor | None  # (D,)


class InductorPagedBackend(SDPABackend):
    """Decodes through the compiled in-place paged kernel, prefills through SDPA."""

    name = "inductor_paged"
    devices = ("cpu",)

    @classmethod
    def why_not_here(
        cls, device: torch.device, dtype: torch.dtype | None, head_dim: int
    ) -> str | None:
        if not inductor.compiler_available():
            return "needs a C++ compiler for Inductor's CPU kernels"
        return None

    def __init__(self, kv_cache: KVCache, layers: Sequence[AttentionSpec]) -> None:
        super().__init__(kv_cache, layers)
        self._compiled = True
        inductor.configure()

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        dec = layout.decode_indices
        if dec.numel() < MIN_PAGED_DECODES:
            return PagedMetadata(**vars(super().build_metadata(layout)), decode_block_tables=None,
                                 decode_context_lens=None)  # fmt: skip
        return PagedMetadata(
            layout=layout,
            decode_rows=layout.cu_seqlens_q[dec],
            decode_blocks=dec,  # unused: no gather
            masks={w: (prefill_masks(layout, w), None) for w in self.windows},
            decode_block_tables=layout.block_tables[dec, : layout.decode_max_blocks],
            decode_context_lens=layout.context_lens[dec],
        )

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SDPAMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata)
        if meta.decode_block_tables is None or meta.decode_context_lens is None:
            return super().attend(layer, q, k, v, meta)
        spec = self.layers[layer]
        out = q.new_empty(q.shape)  # (N, nh, hd)
        prefill_all(self, layer, q, k, v, meta.layout, meta.masks[spec.sliding_window][0], out)
        rows = meta.decode_rows
        out[rows] = self._paged(layer, q[rows], meta.decode_block_tables, meta.decode_context_lens)
        return out

    def _paged(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> torch.Tensor:
        spec = self.layers[layer]
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
        inductor.mark_dynamic(
            [(q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (block_tables, (0, 1)),
             (context_lens, (0,))]
        )  # fmt: skip
        args = (q, k_cache, v_cache, block_tables, context_lens, spec.scale, spec.sliding_window)
        if self._compiled:
            try:
                return _paged_decode(*args)
            except Exception:  # a compiler failure must not fail requests
                inductor.log.exception("attention kernel failed; running it uncompiled")
                self._compiled = False
        return paged_decode(*args)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the decode kernel for each distinct layer geometry (once per process).

        NOTE: under inference mode, as in the forward pass: the compiled graph is guarded on
        it, and on its inputs being inference tensors.
        """
        began = time.monotonic()
        inductor.log.info("compiling the attention kernel", backend=self.name)
        seen = set()
        for layer, spec in enumerate(self.layers):
            if spec in seen:
                continue
            seen.add(spec)
            device = self.kv_cache.k[layer].device
            q = torch.zeros((2, spec.num_heads, spec.head_dim), dtype=self.kv_cache.layout.dtype,
                            device=device)  # fmt: skip
            tables = torch.zeros((2, 2), dtype=torch.long, device=device)
            self._paged(layer, q, tables, torch.ones(2, dtype=torch.long, device=device))
        inductor.log.info(
            "attention kernel ready", backend=self.name, geometries=len(seen),
            seconds=round(time.monotonic() - began, 1),
        )  # fmt: skip
