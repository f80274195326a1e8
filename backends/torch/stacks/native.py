"""The native stack: a decode-only step's decoder layers in one call of cpu_kernels'
`DecodeStack`; every other step eager.

The eager stack (eager.py) calls nine of Carousel's CPU kernels per layer from Python;
at SmolLM2's 30 layers the Python between those calls was about 2 ms of a bf16 step, a
quarter of it at one sequence (docs/benchmarks.md). `DecodeStack` holds every
layer's packed weights, norms and K/V cache tensors once and calls the same kernels in the
same order in C++, so its output is bit for bit the Python loop's.

It runs a step only where that loop would call exactly those kernels: every token a decode
(`cpu_paged` attention's pure decode step) and the token count within the native pack plan's
window. It is never chosen where something sits between the kernels (tensor parallelism's
all-reduces) or where `--compile` runs the layers (stacks/__init__.py).

`--quantization`: where a layer's projections are `QuantLinear`s (layers/quant_linear.py),
the stack holds their weight-only copies too and, in a step of at most their `max_rows` rows,
calls torch's int4 / int8 kernel for them, as the loop would. A quiet server's one-sequence
steps are where those kernels win, and there the Python between them cost as much as the
4-bit bytes saved (docs/benchmarks/history/25-single-stream-llamacpp.md). Copies the stack
cannot take (gate without up, rows that differ) leave those steps to the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backends.torch.attention.base import AttentionMetadata, AttentionSpec
from backends.torch.attention.cpu_paged import CpuPagedMetadata
from backends.torch.kv_cache import KVCache
from backends.torch.layers.linear import Linear, PackPlan
from backends.torch.layers.quant_linear import QuantLinear
from backends.torch.models.base import PROJECTIONS
from backends.torch.stacks import Rope
from backends.torch.stacks.eager import EagerStack


class NativeDecodeLayers:
    """The decoder layers of one `PagedCausalLM` for its decode-only steps (see the module)."""

    def __init__(
        self, stack: Any, linears: Sequence[Any], plan: PackPlan, quantized_rows: int = 0,
        op_rows: int = 0,
    ) -> None:  # fmt: skip
        self.stack = stack
        self.linears = linears  # what the stack's weights came from
        self.plan = plan
        #: steps of at most this many rows take the quantised copies in the stack (0: none)
        self.quantized_rows = quantized_rows
        #: steps of at most this many rows take the linears' quantised copies (0: none)
        self.op_rows = op_rows

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
        if not attention.native_decodes:  # decodes through cpu_paged's kernel
            return None
        kv_cache: KVCache = attention.kv_cache
        stack = kernels.DecodeStack()
        for index, lin in enumerate(linears):
            projections: tuple[Linear, ...] = tuple(
                _dense(op) for op in (lin.qkv, lin.o_proj, lin.down)
            )
            qkv, o_proj, down = projections
            if lin.gate_up is None or any(p.native is None for p in projections):
                return None
            in_w, in_eps, post_w, post_eps = norms[index]
            spec = specs[index]
            stack.add_layer(
                input_norm=in_w, input_eps=in_eps, qkv=qkv.packed, qkv_bias=qkv.packed_bias,
                o_proj=o_proj.packed, o_bias=o_proj.packed_bias, post_norm=post_w,
                post_eps=post_eps, gate_up=lin.gate_up.packed,
                intermediate=lin.gate_up.out_features, down=down.packed,
                down_bias=down.packed_bias, k_cache=kv_cache.k[index],
                v_cache=kv_cache.v[index], num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, scale=spec.scale,
                window=-1 if spec.sliding_window is None else spec.sliding_window,
            )  # fmt: skip
        ops = _quantized_ops(linears)
        op_rows = max((op.max_rows for _, _, op in ops), default=0)
        quantized_rows = 0
        if _stack_runs(ops):
            for index, key, op in ops:
                weight, scales, group_size = op.quantized.stack_args()
                stack.quantize(index, key, weight, scales, group_size, op.dense.bias)
            quantized_rows = op_rows
        return cls(stack, linears, plan, quantized_rows, op_rows)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs exactly as the Python loop would."""
        rows = hidden.shape[0]
        return (
            isinstance(meta, CpuPagedMetadata)
            and meta.all_decodes
            and self.plan.min_rows <= rows <= self.plan.max_rows
            and (rows > self.op_rows or rows <= self.quantized_rows)
        )

    def __call__(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, CpuPagedMetadata)  # see takes
        cos, sin = rope  # (N, 1, hd) each
        out: torch.Tensor = self.stack.forward(
            hidden, cos[:, 0], sin[:, 0], meta.layout.slot_mapping, meta.block_tables,
            meta.context_lens, hidden.shape[0] <= self.quantized_rows,
        )  # fmt: skip
        return out


def _dense(op: Any) -> Any:
    """The full-precision `Linear` of a projection (a `QuantLinear` keeps it as `dense`)."""
    return op.dense if isinstance(op, QuantLinear) else op


def _quantized_ops(linears: Sequence[Any]) -> list[tuple[int, str, QuantLinear]]:
    """(layer, projection, op) of every projection that takes a quantised copy."""
    return [
        (index, key, op)
        for index, lin in enumerate(linears)
        for key in PROJECTIONS
        if isinstance(op := getattr(lin, key), QuantLinear) and op.uses_kernels
    ]


def _stack_runs(ops: Sequence[tuple[int, str, QuantLinear]]) -> bool:
    """Whether the stack can run a quantised step of `ops` as the loop does: not where the
    copies take different rows, or a layer's gate is quantised without its up (or the
    reverse)."""
    if len({op.max_rows for _, _, op in ops}) > 1:
        return False
    gates = {index for index, key, _ in ops if key == "gate"}
    ups = {index for index, key, _ in ops if key == "up"}
    return gates == ups


class NativeStack:
    """Decode-only steps the native call takes (`NativeDecodeLayers.takes`), the rest eager."""

    name = "native"

    def __init__(self, native: NativeDecodeLayers, eager: EagerStack) -> None:
        self.native, self.eager = native, eager

    def __call__(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        if self.native.takes(hidden, meta):
            return self.native(hidden, rope, meta)
        return self.eager(hidden, rope, meta)
