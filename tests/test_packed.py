"""Prepacked oneDNN linears: the same numbers as F.linear, packed once per shared model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from backends.torch import cpu_kernels
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.layers.linear import (
    NATIVE,
    ONEDNN,
    Linear,
    PackPlan,
    cached_linear,
    onednn_packs,
    pack_plan,
)
from backends.torch.model import PagedCausalLM, attention_specs
from backends.torch.runner.backend import TorchBackend
from backends.torch.stacks.compiled import compilable
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer

CPU = torch.device("cpu")


ONEDNN_PLANS = {
    torch.bfloat16: PackPlan(min_rows=1, max_rows=128, batch_hint=1, kernel=ONEDNN),
    torch.float32: PackPlan(min_rows=1, max_rows=128, batch_hint=16, kernel=ONEDNN),
}


def plans(dtype: torch.dtype) -> list[PackPlan]:
    """oneDNN's plan where oneDNN is there, and `pack_plan`'s own (native where it builds)."""
    found = [ONEDNN_PLANS[dtype]] if onednn_packs(dtype) else []
    plan = pack_plan(CPU, dtype)
    return found + [plan] if plan is not None and plan not in found else found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 8, 64, 128, 129, 300])
def test_packed_linear_matches_f_linear_at_every_row_count(dtype: torch.dtype, rows: int) -> None:
    if not plans(dtype):
        pytest.skip("no prepacking on this machine")
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 80, dtype=dtype)
    want = F.linear(x, weight, bias)
    for plan in plans(dtype):
        linear = Linear(weight, bias, plan)
        assert linear.packed is not None
        got = linear(x)
        assert got.dtype == dtype and got.shape == want.shape
        if plan.kernel == ONEDNN and dtype == torch.bfloat16:  # only the reorder is hoisted
            assert torch.equal(got, want)
        elif dtype == torch.bfloat16:  # another fp32 sum order, then one rounding each
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
        else:  # fp32: another blocking, so another summation order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_the_linear_op_packs_on_cpu_within_the_plan_rows_else_runs_f_linear(native: bool) -> None:
    """The per-device choice (packed where a plan packed a copy, with Carousel's kernels or
    oneDNN's) and, on top of it, the per-step one: rows outside the plan take `F.linear`."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    plain = Linear(weight, bias)
    assert not plain.uses_kernels
    x = torch.randn(3, 80)
    assert torch.equal(plain(x), F.linear(x, weight, bias))
    plan = pack_plan(CPU, torch.float32, native=native)
    if plan is None:
        pytest.skip("no prepacking on this machine")
    linear = Linear(weight, bias, plan)
    assert linear.uses_kernels
    assert (linear.native is not None) == (plan.kernel == NATIVE)
    for rows in (plan.min_rows, plan.max_rows, plan.max_rows + 1):
        x = torch.randn(rows, 80)
        with _TorchCalls() as calls:
            got = linear(x)
        assert (F.linear in calls.seen) == (rows > plan.max_rows), rows
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


class _TorchCalls(TorchFunctionMode):
    """The torch functions called inside (Carousel's kernels and oneDNN's op are not `F.linear`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _NoBias(Linear):
    def __init__(self, inner: Linear) -> None:
        self.adopt(inner, bias=False)


def test_a_linear_adopting_another_without_its_bias_adds_none() -> None:
    """What a row-parallel projection off rank 0 does (parallel/layers.py)."""
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    x = torch.randn(4, 80)
    for plan in [None, *plans(torch.float32)]:
        inner = Linear(weight, bias, plan)
        adopted = _NoBias(inner)
        assert adopted.packed is inner.packed
        torch.testing.assert_close(adopted(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inner(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.amx_on(), reason="bf16 linears take AMX tiles only here")
def test_on_amx_mixed_steps_of_up_to_256_rows_take_carousels_bf16_kernel() -> None:
    """Past 128 rows (a mixed step with two prompts) AMX tiles still beat `F.linear`; fp32,
    which has no AMX products, and prefills past 256 rows keep torch's kernels."""
    plan = pack_plan(CPU, torch.bfloat16)
    assert plan is not None
    weight = torch.randn(96, 80).to(torch.bfloat16)
    linear = Linear(weight, None, plan)
    kernels = cpu_kernels.native()
    assert kernels is not None
    for rows, ours in ((129, True), (256, True), (257, False)):
        x = torch.randn(rows, 80).to(torch.bfloat16)
        want = kernels.linear(x, linear.packed, 96, None) if ours else F.linear(x, weight)
        assert torch.equal(linear(x), want), rows
    fp32 = pack_plan(CPU, torch.float32)
    assert fp32 is not None and fp32.max_rows == 128


def test_no_plan_off_cpu_or_for_float64() -> None:
    assert pack_plan(torch.device("cuda"), torch.bfloat16) is None
    assert pack_plan(CPU, torch.float64) is None


def small_cache(model: torch.nn.Module) -> KVCache:
    spec = attention_specs(model)[0]  # type: ignore[arg-type]
    layout = KVLayout(len(model.model.layers), spec.num_kv_heads, spec.head_dim, 4, torch.float32)
    return KVCache(layout, 4, CPU)


def test_backends_over_one_model_share_the_packed_weights() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    first = PagedCausalLM(model, small_cache(model))
    second = PagedCausalLM(model, small_cache(model))
    if pack_plan(CPU, torch.bfloat16) is not None:
        assert first.linears[0].qkv.packed is not None
    assert first.linears[0].qkv is second.linears[0].qkv
    assert first.lm_head_linear is second.lm_head_linear
    # a cast makes new parameter tensors: the next backend packs them afresh
    model.to(torch.float32)
    third = PagedCausalLM(model, small_cache(model))
    assert third.linears[0].down is not first.linears[0].down
    assert third.linears[0].down.weight.dtype == torch.float32
    assert cached_linear(model.lm_head, "lm_head", model.lm_head.weight, None, None).plan is None


def test_prepack_weights_false_keeps_one_copy_of_the_weights() -> None:
    backend = TorchBackend(
        tiny_model("qwen2"), tiny_tokenizer(), device="cpu", dtype="bfloat16",
        kv_cache_gb=0.01, prepack_weights=False,
    )  # fmt: skip
    linears = backend.model.linears[0]
    assert all(lin.packed is None for lin in (linears.qkv, linears.o_proj, linears.down))
    assert backend.model.lm_head_linear.packed is None


@pytest.mark.skipif(cpu_kernels.native() is None, reason="no CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_runs_gate_up_and_silu_as_one_kernel_with_the_same_numbers(
    dtype: torch.dtype,
) -> None:
    model = tiny_model("llama").to(dtype)
    paged = PagedCausalLM(model, small_cache(model))
    fused = paged.linears[0]
    assert fused.gate_up is not None
    # one packed copy of gate and up: theirs; the Linears keep the plain weights only
    assert fused.gate.packed is None and fused.up.packed is None
    unfused = PagedCausalLM(model, small_cache(model), fuse_mlp=False)
    assert unfused.linears[0].gate_up is None and unfused.linears[0].gate.packed is not None
    hidden = model.config.hidden_size
    for rows in (1, 7, 64, 128, 129, 300):  # 300: past any plan's rows, the unfused path
        x = torch.randn(rows, hidden).to(dtype)
        assert torch.equal(first_mlp(paged, x), first_mlp(unfused, x)), rows
    second = PagedCausalLM(model, small_cache(model))
    assert second.linears[0].gate_up is fused.gate_up  # arms over one model share it


def first_mlp(paged: PagedCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's MLP output through `paged`'s own ops."""
    ops = paged.ops[0]
    lin = ops.linears
    out: torch.Tensor = lin.down(ops.mlp_act(x, lin.gate, lin.up, lin.gate_up))
    return out


@pytest.mark.skipif(cpu_kernels.native() is None, reason="no CPU kernels here")
def test_a_compiled_model_packs_no_gate_up_the_graph_does_not_use() -> None:
    model = tiny_model("llama")
    if not compilable(attention_specs(model)):
        pytest.skip("no C++ compiler for Inductor")
    paged = PagedCausalLM(model, small_cache(model), compile=True)
    assert paged.compiled and paged.stack.name == "compiled"
    assert paged.linears[0].gate_up is None  # the graph runs gate and up one by one
