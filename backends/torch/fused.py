"""Fused projection weights: one QKV matmul per decoder layer instead of three.

A decode step of a small model is mostly weight reads plus per-op dispatch, so three
`[N, H] x [H, *]` matmuls cost more than one over the concatenated weight (on the 2-core
CPU, SmolLM2 shapes: 38 -> 28 us at N = 1, 109 -> 87 us at N = 8). Gate and up are not
fused here: through oneDNN the doubled `[2I, H]` weight measured slower at N >= 8 (315 -> 422
us); where Carousel's CPU kernels run, packed.GateUp packs them together instead, with the
SiLU in the same kernel. The fused tensor
becomes the only copy: the HF modules' own `weight`/`bias` parameters are re-pointed to row
slices (views) of it, so memory does not grow and the HF model (used by `generate` in the
oracle tests and by other arms sharing these weights) keeps computing exactly what it did.

Fusing is idempotent: a layer already fused (by another backend over the same weights)
reuses its fused tensors. Correctness never depends on the views staying shared: if the HF
model is later moved or cast, its parameters become new tensors and this fused copy simply
stops being shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's fused Q/K/V projection."""

    qkv_weight: torch.Tensor  # (q + 2 * kv, H): rows of q_proj, k_proj, v_proj
    qkv_bias: torch.Tensor | None  # (q + 2 * kv,) when the projections have biases (Qwen2)


_CACHE_ATTR = "_carousel_fused"


def fuse_layer(layer: Any) -> FusedLayer:
    """The fused projections of one HF decoder layer (re-pointing its params to views).

    `layer` is duck-typed: any HF decoder layer with `self_attn.{q,k,v}_proj` Linears.
    """
    cached: FusedLayer | None = getattr(layer, _CACHE_ATTR, None)
    if cached is not None and _still_shared(layer, cached):
        return cached
    attn = layer.self_attn
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    fused = FusedLayer(
        qkv_weight=_concat_rows(qkv, "weight"),
        qkv_bias=_concat_rows(qkv, "bias") if attn.q_proj.bias is not None else None,
    )
    setattr(layer, _CACHE_ATTR, fused)
    return fused


def _concat_rows(modules: list[Any], name: str) -> torch.Tensor:
    """Concatenate the modules' `name` params along dim 0; make each param a view of it."""
    with torch.no_grad():
        fused = torch.cat([getattr(m, name).detach() for m in modules], dim=0)
    start = 0
    for module in modules:
        rows = getattr(module, name).shape[0]
        setattr(module, name, nn.Parameter(fused[start : start + rows], requires_grad=False))
        start += rows
    return fused


def _still_shared(layer: Any, fused: FusedLayer) -> bool:
    """Whether the layer's params still live inside `fused` (no move or cast since)."""
    q = layer.self_attn.q_proj.weight
    return (
        q.data_ptr() == fused.qkv_weight.data_ptr()
        and q.dtype == fused.qkv_weight.dtype
        and q.device == fused.qkv_weight.device
    )
