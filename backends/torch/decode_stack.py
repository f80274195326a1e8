"""A decode-only step's decoder layers in one native call (cpu_kernels' `DecodeStack`).

`PagedCausalLM._eager_layers` calls nine of Carousel's CPU kernels per layer from Python;
at SmolLM2's 30 layers the Python between those calls was about 2 ms of a bf16 step, a
quarter of it at one sequence (docs/benchmarks.md). `DecodeStack` holds every
layer's packed weights, norms and K/V cache tensors once and calls the same kernels in the
same order in C++, so its output is bit for bit the Python loop's.

It runs a step only where that loop would call exactly those kernels: every token a decode
(`cpu_paged` attention's pure decode step), the token count within the native pack plan's
window, and `model.linears` still the ones it was built from (tensor parallelism swaps in
row-parallel linears; `--compile` rebuilds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backends.torch.attention.base import AttentionMetadata, AttentionSpec
from backends.torch.attention.cpu_paged import CpuPagedBackend, CpuPagedMetadata
from backends.torch.kv_cache import KVCache
from backends.torch.packed import Linear, PackPlan


class NativeDecodeLayers:
    """The decoder layers of one `PagedCausalLM` for its decode-only steps (see the module)."""

    def __init__(self, stack: Any, linears: Sequence[Any], plan: PackPlan) -> None:
        self.stack = stack
        self.linears = linears  # what the stack's weights came from
        self.plan = plan

    @classmethod
    def build(
        cls,
        kernels: Any,
        linears: Sequence[Any],
        norms: Sequence[tuple[torch.Tensor, float, torch.Tensor, float]],
        specs: Sequence[AttentionSpec],
        attention: Any,
        plan: PackPlan | None,
    ) -> NativeDecodeLayers | None:
        """One over these layers, or None where some layer is not all Carousel's kernels.

        The caller vouches that rotary and the K/V write can be `rotary_write_kv` (every
        layer's rotary op took that kernel); decodes must go to cpu_paged's kernel.
        """
        if kernels is None or plan is None or not linears:
            return None
        if not isinstance(attention, CpuPagedBackend):
            return None
        kv_cache: KVCache = attention.kv_cache
        stack = kernels.DecodeStack()
        for index, lin in enumerate(linears):
            projections: tuple[Linear, ...] = (lin.qkv, lin.o_proj, lin.down)
            if lin.gate_up is None or any(p.native is None for p in projections):
                return None
            in_w, in_eps, post_w, post_eps = norms[index]
            spec = specs[index]
            stack.add_layer(
                input_norm=in_w, input_eps=in_eps, qkv=lin.qkv.packed, qkv_bias=lin.qkv.packed_bias,
                o_proj=lin.o_proj.packed, o_bias=lin.o_proj.packed_bias, post_norm=post_w,
                post_eps=post_eps, gate_up=lin.gate_up.packed,
                intermediate=lin.gate_up.out_features, down=lin.down.packed,
                down_bias=lin.down.packed_bias, k_cache=kv_cache.k[index],
                v_cache=kv_cache.v[index], num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, scale=spec.scale,
                window=-1 if spec.sliding_window is None else spec.sliding_window,
            )  # fmt: skip
        return cls(stack, linears, plan)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata, linears: Sequence[Any]) -> bool:
        """Whether this step is one the stack runs exactly as the Python loop would."""
        return (
            isinstance(meta, CpuPagedMetadata)
            and meta.all_decodes
            and self.plan.min_rows <= hidden.shape[0] <= self.plan.max_rows
            and linears is self.linears
        )

    def __call__(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, CpuPagedMetadata)  # see takes
        cos, sin = rope  # (N, 1, hd) each
        out: torch.Tensor = self.stack.forward(
            hidden, cos[:, 0], sin[:, 0], meta.layout.slot_mapping, meta.block_tables,
            meta.context_lens,
        )  # fmt: skip
        return out
