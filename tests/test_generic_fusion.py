"""The generic path's fused swaps (backends/torch/generic/fusion.py): found generically, taken
during steps, exact, and given back between them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.generic import model as generic_model_module
from backends.torch.generic.fusion import Fusion, FusionReport, build_fusion, check
from backends.torch.generic.model import prepare
from backends.torch.generic.norms import offset_norm
from backends.torch.generic.siblings import SiblingGroup
from backends.torch.layers.linear import Linear, pack_plan
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from tests.test_generic_oracle import generic_backend, generic_model, greedy, token_ids
from tests.test_oracle import DELAYS_S, MAX_TOKENS, hf_greedy, prompts

KERNELS = kernels.computes(torch.float32)  # the tiny models are fp32


def expected_report(model: PreTrainedModel) -> FusionReport:
    """What a Llama-shaped model's swaps take: every layer's q/k/v and MLP, every norm where
    the CPU kernels run (there, the MLPs go through their gate/up/SiLU kernel)."""
    layers = model.config.num_hidden_layers
    return FusionReport(
        qkv=layers,
        gate_up=0 if KERNELS else layers,
        silu_mlps=layers if KERNELS else 0,
        norms=2 * layers + 1 if KERNELS else 0,
        folded=layers if KERNELS else 0,
        packed=2 * layers + 1,  # o_proj, down_proj, lm_head
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_and_qwen2_shapes_take_the_fused_path_with_the_same_tokens(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = generic_model(arch)
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    fused = generic_backend(model)
    assert fused.model.fusion.report == expected_report(model)
    monkeypatch.setattr(generic_model_module, "FUSE", False)
    unfused = generic_backend(model)
    assert unfused.model.fusion.report == FusionReport(packed=7 * 2 + 1)
    monkeypatch.undo()

    groups = fused.model.fusion.groups
    for group in groups:
        group.products = 0
    forwards, mlp_projections = count_calls(model)
    # NOTE: steps of at most 64 rows: all inside the kernels' window (past it, HF's own MLP)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True)
    with LLM(fused, "orca", config) as llm:
        assert token_ids(llm.generate(prompts(), greedy(MAX_TOKENS), DELAYS_S)) == expected
    # one fused q/k/v product per layer and forward: k and v took their slices of it
    assert forwards and {g.products for g in groups} == {len(forwards)}
    layers = model.config.num_hidden_layers
    assert len(mlp_projections) == (0 if KERNELS else 2 * len(forwards) * layers)
    with LLM(unfused, "orca", config) as llm:
        assert token_ids(llm.generate(prompts(), greedy(MAX_TOKENS), DELAYS_S)) == expected


def count_calls(model: PreTrainedModel) -> tuple[list[int], list[int]]:
    """Lists growing by one per forward of `model`'s base model, and per call of any MLP's
    gate or up projection module (the SiLU-MLP kernel calls neither)."""
    forwards: list[int] = []
    projections: list[int] = []
    model.base_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    for name, module in model.named_modules():
        if name.endswith(("gate_proj", "up_proj")):
            module.register_forward_pre_hook(lambda *_: projections.append(1))
    return forwards, projections


def test_swaps_compute_what_the_hf_modules_do() -> None:
    """HF's own forward (its eager attention) with every swap in equals it without, in fp32,
    and the norms did run on the kernels, the post-attention ones with the residual add."""
    model = generic_model("qwen2")
    spy = KernelSpy(kernels.native()) if KERNELS else None
    fusion = build_fusion(model, pack_plan(torch.device("cpu"), torch.float32), spy, DTYPES)
    assert_swaps_keep_the_logits(model, fusion)
    if spy is not None:  # each layer's input norm and the final one; each post-attention one
        layers = model.config.num_hidden_layers
        assert (spy.norms, spy.folds) == (layers + 1, layers) == (layers + 1, fusion.report.folded)


def assert_swaps_keep_the_logits(model: PreTrainedModel, fusion: Fusion) -> None:
    """HF's own forward of one prompt with `fusion`'s swaps in equals it without (fp32)."""
    ids = torch.tensor([prompts()[5]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with fusion.swaps.swapped_in():
            after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


DTYPES = (torch.float32,)


class KernelSpy:
    """The CPU kernels, counting their norm calls (alone, and with the residual add)."""

    def __init__(self, native: Any) -> None:
        self.native, self.norms, self.folds = native, 0, 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.norms += 1
        out: torch.Tensor = self.native.rms_norm(x, weight, eps)
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        self.folds += 1
        out: torch.Tensor = self.native.add_rms_norm(hidden, delta, weight, eps)
        return out


def test_other_formulas_keep_their_own_code() -> None:
    """Gemma 3's `(1 + w)` norms are not Llama's: none taken as one, each taken as an offset
    norm (six a layer: input, q, k, post-attention, pre- and post-feedforward; and the final
    one); its GELU MLP is not the SiLU kernel's: gate and up fused as siblings instead. Phi-3
    fuses its own projections."""
    model = generic_model("gemma3")
    gemma = generic_backend(model).model.fusion.report
    assert (gemma.norms, gemma.silu_mlps, gemma.qkv, gemma.gate_up) == (0, 0, 2, 2)
    layers = model.config.num_hidden_layers
    assert gemma.offset_norms == (6 * layers + 1 if KERNELS else 0)
    phi3 = generic_backend(generic_model("phi3")).model.fusion.report
    assert (phi3.qkv, phi3.gate_up, phi3.silu_mlps) == (0, 0, 0)


def test_the_hf_model_is_given_back_with_fused_weights_computing_the_same() -> None:
    model = generic_model("llama")
    before = hf_greedy(model, prompts()[1], 8)
    backend = generic_backend(model)
    with LLM(backend, "orca", SchedulerConfig(max_num_seqs=4)) as llm:
        assert token_ids(llm.generate([prompts()[1]], greedy([8]))) == [before]
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    assert all(not g.products or g._input is None for g in backend.model.fusion.groups)
    assert hf_greedy(model, prompts()[1], 8) == before


def test_a_swap_the_model_does_not_fit_is_dropped_at_load() -> None:
    model = generic_model("llama")
    layers = prepare(model)
    plan = pack_plan(torch.device("cpu"), torch.float32)
    fusion = build_fusion(model, plan, None)
    assert fusion.report.qkv == 2
    attn = model.model.layers[0].self_attn

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a view the modeling code cannot take")

    fusion.swaps.put(attn.q_proj, broken)
    kept = check(model, fusion, layers, plan)
    assert isinstance(kept, Fusion) and dataclasses.replace(kept.report, packed=0) == FusionReport()
    assert check(model, build_fusion(model, plan, None), layers, plan).report.qkv == 2


def test_siblings_serve_each_call_its_own_projection() -> None:
    """Any order, another input, or a second call on the same input: each member's own
    projection of its own input."""
    torch.manual_seed(0)
    members = [nn.Linear(8, n, bias=True) for n in (4, 2, 2)]
    fused = Linear(torch.cat([m.weight for m in members]), torch.cat([m.bias for m in members]))
    group = SiblingGroup(members, fused)
    x, y = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    calls = [(1, x), (0, x), (2, y), (2, y), (0, y), (1, x)]
    with torch.no_grad():
        for index, tensor in calls:
            torch.testing.assert_close(group.take(index, tensor), members[index](tensor))
    assert group.products == 4  # x; y; y again (member 2 twice); x again (left for y)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_offset_norm_swaps_compute_what_the_hf_modules_do(arch: str) -> None:
    """Gemma's `(1 + w)` norms on the kernel in fp32: HF's own forward with the swaps in equals
    it without (fp32 logits; bf16 hidden states to one bf16 step), and every norm ran there."""
    if not KERNELS:
        pytest.fail("the offset norms need the CPU kernels, which build on every CI machine")
    model = generic_model(arch)
    spy = KernelSpy(kernels.native())
    fusion = build_fusion(model, None, spy, DTYPES)
    layers = model.config.num_hidden_layers
    per_layer = 6 if arch == "gemma3" else 4  # Gemma 2 has no q/k norms
    assert fusion.report.offset_norms == per_layer * layers + 1
    assert_swaps_keep_the_logits(model, fusion)
    assert spy.norms == per_layer * layers + 1
    norm = next(m for m in model.modules() if offset_norm(m))
    x = torch.randn(7, 3, norm.weight.shape[0]).bfloat16()
    with torch.inference_mode():
        hf = norm(x)
        with fusion.swaps.swapped_in():
            ours = norm(x)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), hf.float(), rtol=8e-3, atol=1e-6)
