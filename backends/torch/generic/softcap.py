"""Attention with soft-capped scores (Gemma 2's `attn_logit_softcapping`) over the paged cache.

No attention backend caps scores (`softcap * tanh(scores / softcap)` before the softmax), so
these layers are computed here with torch ops, in the order of transformers' eager attention:
each sequence's new queries against its whole context gathered from its block table, scaled,
capped, masked (causal, and the layer's sliding window), softmax in fp32. One sequence at a
time: correct, not fast (a capped layer costs what the `sdpa` backend's prefill path costs per
sequence, decodes included).
"""

from __future__ import annotations

import torch

from backends.torch.attention.base import AttentionSpec, BatchLayout
from backends.torch.kv_cache import KVCache


def softcap_attention(
    cache: KVCache,
    layer: int,
    spec: AttentionSpec,
    softcap: float,
    q: torch.Tensor,
    layout: BatchLayout,
) -> torch.Tensor:
    """Output (N, nh, hd) of every scheduled token for queries `q` (N, nh, hd), this step's
    K/V already in `cache`."""
    out = q.new_empty(q.shape)
    nkv, g, hd = spec.num_kv_heads, spec.group_size, spec.head_dim
    for i in range(layout.num_seqs):
        start, num_new, ctx = layout.query_starts[i], layout.seqlens_q[i], layout.seqlens_k[i]
        blocks = layout.block_tables[i, : -(-ctx // cache.block_size)]
        keys = cache.k[layer][blocks].view(-1, nkv, hd)[:ctx]  # (C, nkv, hd)
        values = cache.v[layer][blocks].view(-1, nkv, hd)[:ctx]
        queries = q[start : start + num_new].view(num_new, nkv, g, hd).permute(1, 2, 0, 3)
        scores = queries @ keys.permute(1, 2, 0)[:, None] * spec.scale  # (nkv, g, L, C)
        scores = torch.tanh(scores / softcap) * softcap
        allowed = _allowed(ctx, num_new, spec.sliding_window, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = probs @ values.transpose(0, 1)[:, None]  # (nkv, g, L, hd)
        out[start : start + num_new] = o.permute(2, 0, 1, 3).reshape(num_new, nkv * g, hd)
    return out


def _allowed(ctx: int, num_new: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(L, C) True where the last `num_new` of `ctx` positions attend (causal, windowed)."""
    k_pos = torch.arange(ctx, device=device)
    q_pos = k_pos[ctx - num_new :, None]  # (L, 1)
    allowed = k_pos[None, :] <= q_pos
    if window is not None:
        allowed &= k_pos[None, :] > q_pos - window
    return allowed
