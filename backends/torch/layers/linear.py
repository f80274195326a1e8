"""Linear layers with prepacked weights for decode-sized matmuls on CPU.

Where Carousel's own CPU kernels build (AVX-512 with BF16, or AVX2; backends/torch/cpu_kernels),
fp32 and bf16 weights are packed into their 64-row tiles and decode-sized calls go to
`kernels.native().linear`, which streams each weight once: all SmolLM2 projections in
turn, from memory, on the 2-core EPYC (ms, ours vs oneDNN's prepacked path): bf16 1 row
3.6 vs 6.1, 8 rows 5.5 vs 7.7, 64 rows 19.5 vs 22.3; fp32 1 row 7.2 vs 10.6, 8 rows 10.1 vs
12.0, 64 rows 35.1 vs 39.5 (docs/benchmarks/history/). Elsewhere, oneDNN's prepacked path:

`F.linear` on CPU reorders the weight into oneDNN's blocked layout on every call (bf16), or
runs a GEMM that is slow for a handful of rows (fp32). Packing each weight once
(`torch.ops.mkldnn._reorder_linear_weight`, the path torch.compile's CPU freezing uses) and
calling `_linear_pointwise` is much faster at decode sizes. Measured on the 2-core AMX CPU
with SmolLM2 shapes (us per call, plain -> packed):

- bf16, hint 1: 1 row 67 -> 34, 64 rows 122 -> 69; lm_head 2.0 -> 1.2 ms. Bit-identical.
- fp32, hint 16: 16 rows 188 -> 137, 32 rows 564 -> 256 (down_proj). Another blocking, so
  another summation order: equal to `F.linear` within 1e-5, not bitwise. One weight alone
  in cache, 1 row read 40 -> 55 us; but a decode step streams every weight from memory, and
  there, on the 2-core AVX512-BF16 EPYC (all 151 SmolLM2 projections in turn, cold), `F.linear`
  reads 16 GB/s and the packed path 52 GB/s: 1 row 32.3 -> 10.3 ms, 8 rows 52.6 -> 14.7 ms,
  64 rows 133 -> 48 ms. So fp32 packs from 1 row too.

With many rows (prefill) the plain path is as fast or faster, so calls outside a plan's row
window take it (past 128 rows; past 256 in bf16 where the linears take AMX tiles). The
packed copy is extra memory (one more copy of every projection and of lm_head):
`carousel serve --no-prepack-weights` keeps one copy and the plain path.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from backends.torch import kernels
from backends.torch.layers.custom_op import CustomOp

ONEDNN = "onednn"
NATIVE = "native"  # backends/torch/cpu_kernels


@dataclass(frozen=True)
class PackPlan:
    """When a matmul takes the prepacked path (`min_rows..max_rows` rows), and which kernel."""

    min_rows: int
    max_rows: int
    batch_hint: int  # the batch size oneDNN packs the weight for
    kernel: str = ONEDNN


#: measured on the 2-core CPUs with SmolLM2 shapes (see the module docstring)
_PLANS = {
    torch.bfloat16: PackPlan(min_rows=1, max_rows=128, batch_hint=1),
    torch.float16: PackPlan(min_rows=1, max_rows=128, batch_hint=1),
    torch.float32: PackPlan(min_rows=1, max_rows=128, batch_hint=16),
}


#: Carousel's kernels beat oneDNN's prepacked path at every row count up to here
_NATIVE_PLAN = PackPlan(min_rows=1, max_rows=128, batch_hint=0, kernel=NATIVE)

#: bf16 where its linears take AMX tiles: Carousel's kernels against torch's own `F.linear`
#: (oneDNN, AMX too), all SmolLM2 projections in turn on the 2-core AMX Xeon, 1.59x at 128
#: rows, 1.62x at 155, 1.31x at 256; from 512 rows on about even (0.74-1.26x over runs), so
#: larger prefills keep `F.linear` (docs/benchmarks/history/). A mixed step (decodes and a
#: prompt or two) is past 128 rows as soon as it carries two prompts.
_NATIVE_AMX_PLAN = PackPlan(min_rows=1, max_rows=256, batch_hint=0, kernel=NATIVE)


#: the most rows any step has (`batch_invariant`: no step's rows leave the packed kernel)
EVERY_ROW = 2**62


def invariant_plan(plan: PackPlan | None) -> PackPlan:
    """`plan` taking Carousel's packed kernel at every row count (`batch_invariant`).

    That kernel computes each row alone (its K sum in one order, whatever the other rows:
    tests/test_batch_invariance.py), so a row's output never depends on the step's rows.
    ValueError where there is no such plan (no CPU kernels, not a CPU, a dtype they lack).
    """
    if plan is None or plan.kernel != NATIVE:
        why = kernels.why_off() if kernels.native() is None else "not for this device or dtype"
        raise ValueError(f"batch_invariant needs Carousel's CPU kernels' linears: {why}")
    return dataclasses.replace(plan, max_rows=EVERY_ROW)


def pack_plan(device: torch.device, dtype: torch.dtype, *, native: bool = True) -> PackPlan | None:
    """When prepacked linears pay off for this device and dtype, and whose (None: never).

    `native=False` leaves Carousel's own kernels out (oneDNN's, where it is there).
    """
    if device.type != "cpu":
        return None
    if native and kernels.computes(dtype):
        amx = dtype == torch.bfloat16 and kernels.amx_on()
        return _NATIVE_AMX_PLAN if amx else _NATIVE_PLAN
    if not onednn_packs(dtype):
        return None
    return _PLANS.get(dtype)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here for `dtype`.

    Its bf16 and fp16 reorders need the CPU's support (bf16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
    on an AVX2-only CPU `_reorder_linear_weight` raises, so those dtypes keep `F.linear`.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


class Linear(CustomOp):
    """`y = x @ weight.T + bias`, through a prepacked weight when one was built.

    A layer op (layers/custom_op.py): `forward_native` is `F.linear`; the CPU implementation,
    chosen once at load where `plan` packed a copy (Carousel's kernels' or oneDNN's), is the
    packed path. On top of that per-device choice it keeps a per-step rule: each call whose
    row count is outside `plan`'s `min_rows..max_rows` window (prefill, big mixed steps) takes
    `F.linear`, which is as fast or faster there. CUDA (never packed: `pack_plan` is None
    off the CPU) runs `forward_native`.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, plan: PackPlan | None = None
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.plan = plan
        self.out_features = weight.shape[0]
        # what the packed copy was made from (`.to()` swaps a parameter's data in place)
        self.source = _source(weight)
        self.packed: torch.Tensor | None = None
        self.packed_bias: torch.Tensor | None = None
        self.native: Any = None
        if plan is not None and plan.kernel == NATIVE and not kernels.packable(weight):
            self.plan = plan = None
        if plan is not None and plan.kernel == NATIVE:
            self.native = kernels.native()
            if self.native is None:
                raise RuntimeError("a native pack plan without Carousel's CPU kernels")
            with torch.no_grad():
                self.packed = kernels.pack_weight(weight)
                self.packed_bias = kernels.pack_bias(bias, self.out_features)
        elif plan is not None:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), plan.batch_hint
                )
        # the kernels the packed copy is for: Carousel's, oneDNN's, or none (no plan)
        packer = self.native if self.native is not None else torch.ops.mkldnn
        super().__init__(weight.device, packer if self.plan is not None else None)

    def adopt(self, inner: Linear, *, bias: bool = True) -> None:
        """Take `inner`'s weight and packed copy (no repacking); `bias=False` drops its bias."""
        self.__dict__.update(inner.__dict__)
        if not bias:
            self.bias = self.packed_bias = None
        # `inner`'s chosen forward is bound to `inner` (its bias): choose again, for `self`
        self._forward = self.dispatch_forward(self.weight.device)

    def with_plan(self, plan: PackPlan) -> Linear:
        """This linear under `plan`'s row window, sharing its packed copy (same packing)."""
        assert _same_packing(self.plan, plan)
        other = copy.copy(self)
        other.plan = plan
        other._forward = other.dispatch_forward(other.weight.device)  # bound to `other`
        return other

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._forward(x)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        assert plan is not None
        if not plan.min_rows <= x.shape[0] <= plan.max_rows:
            return F.linear(x, self.weight, self.bias)
        if self.native is not None:
            out: torch.Tensor = self.native.linear(
                x.contiguous(), self.packed, self.out_features, self.packed_bias
            )
            return out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


_CACHE_ATTR = "_carousel_linears"


def cached_linear(
    owner: Any, key: str, weight: torch.Tensor, bias: torch.Tensor | None, plan: PackPlan | None
) -> Linear:
    """A `Linear` over `weight`, built once per `owner` (a module) and `key`.

    Backends sharing one loaded model (A/B arms) then share one packed copy too. A cached
    entry is reused only while it wraps this very weight tensor with the same data (not after a
    move or cast, which swap a parameter's data in place).
    """
    cache: dict[str, Linear] = owner.__dict__.setdefault(_CACHE_ATTR, {})
    linear = cache.get(key)
    if linear is None or linear.weight is not weight or linear.source != _source(weight):
        linear = cache[key] = Linear(weight, bias, plan)
    elif linear.plan != plan:  # another row window over the same packing shares the copy
        if not _same_packing(linear.plan, plan):
            linear = cache[key] = Linear(weight, bias, plan)
        else:
            assert plan is not None  # see _same_packing
            return linear.with_plan(plan)
    return linear


def _source(weight: torch.Tensor) -> tuple[int, torch.dtype, torch.device]:
    return weight.data_ptr(), weight.dtype, weight.device


def _same_packing(a: PackPlan | None, b: PackPlan | None) -> bool:
    """Whether plans `a` and `b` pack a weight alike (they may differ in their row window)."""
    return a is not None and b is not None and (a.kernel, a.batch_hint) == (b.kernel, b.batch_hint)


class GateUp:
    """`silu(x @ gate.T) * (x @ up.T)`: the MLP's first half as one kernel over one weight.

    Carousel's `linear_silu_mul` over gate and up packed together (`pack_gate_up`), for the
    row counts of the native plan's window (`takes`); it rounds as HF's
    `act_fn(gate(x)) * up(x)` does, bit for bit as the `linear` and `silu_mul` kernels do.
    One call instead of three per layer, and no gate or up tensors.
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, plan: PackPlan) -> None:
        self.plan = plan
        self.out_features = gate.shape[0]
        self.sources = (_source(gate), _source(up))
        native = kernels.native()
        if native is None:
            raise RuntimeError("GateUp without Carousel's CPU kernels")
        self.kernels = native
        with torch.no_grad():
            self.packed = kernels.pack_gate_up(gate, up)

    def takes(self, x: torch.Tensor) -> bool:
        return self.plan.min_rows <= x.shape[0] <= self.plan.max_rows

    def with_plan(self, plan: PackPlan) -> GateUp:
        """This `GateUp` under `plan`'s row window, sharing its packed copy."""
        other = copy.copy(self)
        other.plan = plan
        return other

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_silu_mul(x.contiguous(), self.packed, self.out_features)


def fusable_gate_up(plan: PackPlan | None, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `GateUp` can take these weights under `plan` (Carousel's kernels' plan)."""
    return (
        plan is not None
        and plan.kernel == NATIVE
        and kernels.native() is not None
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and kernels.packable(gate)
    )


_GATE_UP_KEY = "gate_up"  # its entry among a module's cached linears


def cached_gate_up(owner: Any, gate: torch.Tensor, up: torch.Tensor, plan: PackPlan) -> GateUp:
    """A `GateUp` over `gate` and `up`, built once per `owner` (a module) as `cached_linear`
    builds a `Linear`: arms sharing one model share one packed copy."""
    cache: dict[str, Any] = owner.__dict__.setdefault(_CACHE_ATTR, {})
    fused = cache.get(_GATE_UP_KEY)
    if not isinstance(fused, GateUp) or fused.sources != (_source(gate), _source(up)):
        fused = cache[_GATE_UP_KEY] = GateUp(gate, up, plan)
    elif fused.plan != plan:  # only its row window differs (every GateUp plan is native)
        return fused.with_plan(plan)
    return fused
