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

Fusing is idempotent: modules already fused (by another backend over the same weights)
reuse their fused tensors. Correctness never depends on the views staying shared: if the HF
model is later moved or cast, its parameters become new tensors and this fused copy simply
stops being shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from backends.torch.layers.weights import LinearWeights

_CACHE_ATTR = "_carousel_fused"


def fuse_rows(owner: Any, key: str, modules: Sequence[Any]) -> LinearWeights:
    """The row-wise concatenation of `modules`' weights (and biases, where the first has one),
    cached on `owner` under `key`; each module's params are re-pointed to views of it.

    `modules` are duck-typed: anything with `weight` and `bias` params (nn.Linear).
    """
    cache: dict[str, LinearWeights] = owner.__dict__.setdefault(_CACHE_ATTR, {})
    cached = cache.get(key)
    if cached is not None and _still_shared(modules[0], cached):
        return cached
    fused = LinearWeights(
        weight=_concat_rows(modules, "weight"),
        bias=_concat_rows(modules, "bias") if modules[0].bias is not None else None,
    )
    cache[key] = fused
    return fused


def _concat_rows(modules: Sequence[Any], name: str) -> torch.Tensor:
    """Concatenate the modules' `name` params along dim 0; make each param a view of it."""
    with torch.no_grad():
        fused = torch.cat([getattr(m, name).detach() for m in modules], dim=0)
    start = 0
    for module in modules:
        rows = getattr(module, name).shape[0]
        setattr(module, name, nn.Parameter(fused[start : start + rows], requires_grad=False))
        start += rows
    return fused


def _still_shared(first: Any, fused: LinearWeights) -> bool:
    """Whether the first module's params still live inside `fused` (no move or cast since)."""
    weight = first.weight
    return (
        weight.data_ptr() == fused.weight.data_ptr()
        and weight.dtype == fused.weight.dtype
        and weight.device == fused.weight.device
    )
