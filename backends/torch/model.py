"""Selective batching over a paged KV cache, reusing the modules of a loaded HF causal LM.

Every op but attention (embedding, RMSNorm, QKV/output projections, MLP, final norm, lm_head)
runs once over the flat `[N, hidden]` tensor of all scheduled tokens of all sequences, with
the Q/K/V projections fused into one matmul (fused.py). Only
attention is per sequence: new K/V go into the cache through `slot_mapping`, then each
sequence attends to its own context gathered through its block table. Sequences with one new
token (decodes) share one batched, masked attention call. No padding of the token dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from backends.torch.fused import FusedLayer, fuse_layer
from backends.torch.kv_cache import KVCache
from backends.torch.loader import check_architecture
from backends.torch.packed import Linear, PackPlan, cached_linear, pack_plan


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's scheduled tokens sit in the flat batch and in the paged KV cache.

    Sequence `i` owns flat rows `[cu_seqlens_q[i], cu_seqlens_q[i + 1])`. After this step's
    K/V are written, its context is slots `[0, seqlens_k[i])` of its block table, the last
    `seqlens_q[i]` of which are the new tokens.

    NOTE: `block_tables` rows are padded with block 0 to a common width; nothing past a
    sequence's context length is ever attended to.
    """

    cu_seqlens_q: torch.Tensor  # (B + 1,) int64
    context_lens: torch.Tensor  # (B,) int64, == seqlens_k
    slot_mapping: torch.Tensor  # (N,) int64, cache slot of every scheduled token
    block_tables: torch.Tensor  # (B, max_blocks) int64
    query_starts: tuple[int, ...]  # host copies, to slice without device syncs
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    decode_indices: torch.Tensor  # (D,) int64, sequences with exactly one new token
    decode_max_blocks: int  # widest block table among the decodes
    prefill_indices: tuple[int, ...]  # sequences with more than one new token

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_q)


@dataclass(frozen=True)
class _LayerLinears:
    """One decoder layer's projections as `Linear`s (prepacked where that pays)."""

    qkv: Linear
    o_proj: Linear
    gate: Linear
    up: Linear
    down: Linear

    @classmethod
    def of(cls, layer: Any, fused: FusedLayer, plan: PackPlan | None) -> _LayerLinears:
        attn, mlp = layer.self_attn, layer.mlp

        def wrap(key: str, module: Any) -> Linear:
            return cached_linear(layer, key, module.weight, module.bias, plan)

        return cls(
            qkv=cached_linear(layer, "qkv", fused.qkv_weight, fused.qkv_bias, plan),
            o_proj=wrap("o_proj", attn.o_proj),
            gate=wrap("gate", mlp.gate_proj),
            up=wrap("up", mlp.up_proj),
            down=wrap("down", mlp.down_proj),
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _sliding_window(attn: nn.Module, config: object) -> int | None:
    """Per-layer window (Qwen2/3 set it on the module), else the config's (Mistral)."""
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    return None if window is None else int(window)


class PagedCausalLM:
    """The forward pass of a Llama/Mistral/Qwen2/Qwen3 HF model over a paged KV cache."""

    def __init__(
        self, hf_model: PreTrainedModel, kv_cache: KVCache, *, prepack: bool = True
    ) -> None:
        check_architecture(type(hf_model).__name__)
        config = hf_model.config
        base = hf_model.model
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        weight = hf_model.lm_head.weight
        plan = pack_plan(weight.device, weight.dtype) if prepack else None
        self.linears = [_LayerLinears.of(layer, fuse_layer(layer), plan) for layer in self.layers]
        self.lm_head_linear = cached_linear(hf_model.lm_head, "lm_head", weight, None, plan)
        self.windows = [_sliding_window(layer.self_attn, config) for layer in self.layers]
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B', V) at the last scheduled token of sequences `logits_indices` (all)."""
        hidden = self.embed_tokens(input_ids)  # (N, H)
        cos, sin = self.rotary_emb(hidden, positions[None])  # (1, N, hd) each
        rope = (cos[0, :, None, :], sin[0, :, None, :])  # (N, 1, hd): broadcast over heads
        masks = {w: self._masks(meta, w) for w in set(self.windows)}
        for layer_idx, layer in enumerate(self.layers):
            attn_in = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(layer_idx, attn_in, rope, meta, masks)
            hidden = hidden + self._mlp(layer_idx, layer.post_attention_layernorm(hidden))
        last = meta.cu_seqlens_q[1:] - 1  # (B,)
        if logits_indices is not None:
            last = last[logits_indices]
        # NOTE: the final norm is per token, so norming only the rows we need is identical.
        return self.lm_head_linear(self.norm(hidden[last]))  # (B', V)

    __call__ = forward

    def _mlp(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        lin = self.linears[layer_idx]
        return lin.down(self.layers[layer_idx].mlp.act_fn(lin.gate(x)) * lin.up(x))

    def _attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        masks: dict[int | None, tuple[list[torch.Tensor | None], torch.Tensor | None]],
    ) -> torch.Tensor:
        attn = self.layers[layer_idx].self_attn
        n, hd, nh = x.shape[0], self.head_dim, self.num_heads
        qkv = self.linears[layer_idx].qkv(x)  # (N, q + 2 * kv)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, hd)  # (N, nkv, hd)
        cos, sin = rope
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before rotary
            q = attn.q_norm(qkv[:, : self.q_size].view(n, nh, hd))
            k = attn.k_norm(qkv[:, self.q_size : qk_size].view(n, self.num_kv_heads, hd))
            q = q * cos + rotate_half(q) * sin  # (N, nh, hd)
            k = k * cos + rotate_half(k) * sin  # (N, nkv, hd)
        else:  # one rotary over the Q and K heads together
            qk = qkv[:, :qk_size].view(n, nh + self.num_kv_heads, hd)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :nh], qk[:, nh:]
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        k_cache.view(-1, self.num_kv_heads, hd).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, hd).index_copy_(0, meta.slot_mapping, v)
        prefill_masks, decode_mask = masks[self.windows[layer_idx]]
        out = q.new_empty((n, nh, hd))
        for i, mask in zip(meta.prefill_indices, prefill_masks, strict=True):
            self._prefill(i, q, k, v, k_cache, v_cache, meta, mask, attn.scaling, out)
        if decode_mask is not None:
            self._decode(q, k_cache, v_cache, meta, decode_mask, attn.scaling, out)
        return self.linears[layer_idx].o_proj(out.view(n, self.q_size))  # (N, H)

    def _prefill(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        mask: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Sequence `i`'s new tokens against its whole context (causal over the new ones)."""
        start = meta.query_starts[i]
        stop = start + meta.seqlens_q[i]
        ctx = meta.seqlens_k[i]
        if ctx == stop - start:  # nothing cached before: the fresh K/V are the context
            keys, values = k[start:stop], v[start:stop]  # (L, nkv, hd)
        else:
            keys, values = self._gather(k_cache, v_cache, meta.block_tables[i], ctx)
        o = F.scaled_dot_product_attention(
            q[start:stop].transpose(0, 1)[None],  # (1, nh, L, hd)
            keys.transpose(0, 1)[None],  # (1, nkv, C, hd)
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )  # (1, nh, L, hd)
        out[start:stop] = o[0].transpose(0, 1)

    def _gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `ctx` K and V slots of one sequence, each (C, nkv, hd)."""
        num_blocks = -(-ctx // self.kv_cache.block_size)
        blocks = block_table[:num_blocks]
        shape = (-1, self.num_kv_heads, self.head_dim)
        return k_cache[blocks].view(shape)[:ctx], v_cache[blocks].view(shape)[:ctx]

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        mask: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Every one-new-token sequence at once, over block-padded contexts with a mask."""
        dec = meta.decode_indices
        rows = meta.cu_seqlens_q[dec]  # (D,) the decode tokens' flat rows
        blocks = meta.block_tables[dec, : meta.decode_max_blocks].reshape(-1)  # (D * nb,)
        shape = (dec.shape[0], -1, self.num_kv_heads, self.head_dim)
        # NOTE: index_select on the block dim copies about 1.5x faster than 2-D indexing
        keys = k_cache.index_select(0, blocks).view(shape).transpose(1, 2)  # (D, nkv, S, hd)
        values = v_cache.index_select(0, blocks).view(shape).transpose(1, 2)
        # NOTE: the g = nh / nkv query heads sharing a KV head act as g query rows against
        # it (GQA maps head h to KV head h // g), so K/V are never expanded to nh heads;
        # one new token has no causal order among its rows, only the padding/window mask.
        group = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q[rows].view(-1, self.num_kv_heads, group, self.head_dim),  # (D, nkv, g, hd)
            keys,
            values,
            attn_mask=mask,  # (D, 1, 1, nb * bs)
            scale=scale,
        )  # (D, nkv, g, hd)
        out[rows] = o.reshape(-1, self.num_heads, self.head_dim)

    def _masks(
        self, meta: AttentionMetadata, window: int | None
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Boolean attention masks (True = attend) for one sliding window (None = full).

        One per prefill sequence, None where plain causal attention over fresh K/V suffices,
        and one (D, 1, 1, S) mask for the batched decodes (None when there are none).
        """
        device = meta.slot_mapping.device
        prefill: list[torch.Tensor | None] = []
        for i in meta.prefill_indices:
            q_len, ctx = meta.seqlens_q[i], meta.seqlens_k[i]
            if ctx == q_len and window is None:
                prefill.append(None)
                continue
            k_pos = torch.arange(ctx, device=device)
            q_pos = k_pos[ctx - q_len :, None]  # (L, 1)
            allowed = k_pos[None, :] <= q_pos  # (L, C)
            if window is not None:
                allowed &= k_pos[None, :] > q_pos - window
            prefill.append(allowed)
        if meta.decode_indices.numel() == 0:
            return prefill, None
        span = meta.decode_max_blocks * self.kv_cache.block_size
        k_pos = torch.arange(span, device=device)[None, :]  # (1, S)
        ctx_lens = meta.context_lens[meta.decode_indices][:, None]  # (D, 1)
        allowed = k_pos < ctx_lens  # (D, S)
        if window is not None:
            allowed &= k_pos > ctx_lens - 1 - window
        return prefill, allowed[:, None, None, :]  # (D, 1, 1, S)
