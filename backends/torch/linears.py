"""Every projection of a model, each with its method chosen when it is built.

`build_linears` is the one builder (vLLM chooses a linear's `quant_method` when the layer is
built; so does this): from a model's weights record (models/) and the config it decides, per
projection, in order and once:

1. dense: a `Linear` over the weight, prepacked where the pack plan pays (layers/linear.py), and the
   MLP's gate and up packed together where Carousel's kernels fuse them with the SiLU (`GateUp`);
2. quantised: a `QuantLinear` over that `Linear` where `--quantization` gives it an int4 or
   int8 copy (quantization/quantize.py measures the rows it wins for);
3. placed: tensor parallelism's row-parallel `o_proj` and `down` and its gathered LM head
   (`Placement`, parallel/layers.py).

Nothing replaces a projection afterwards: the layer stacks (stacks/) are built from these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from backends.torch.config import TorchBackendConfig
from backends.torch.layers.linear import (
    GateUp,
    Linear,
    PackPlan,
    cached_gate_up,
    cached_linear,
    fusable_gate_up,
)
from backends.torch.layers.quant_linear import QuantLinear
from backends.torch.models import DecoderLayerWeights, ModelWeights
from backends.torch.quantization.quantize import QuantizationReport, quantize_linears


@dataclass(frozen=True)
class LayerLinears:
    """One decoder layer's projections as `Linear`s (prepacked where that pays), each a
    `QuantLinear` over its `Linear` where `--quantization` gave it a quantised copy.

    With `gate_up` (Carousel's kernels, `fuse_mlp`), decode-sized MLP inputs go through it,
    and gate and up keep only their plain weights (larger batches take F.linear anyway).
    """

    qkv: Linear | QuantLinear
    o_proj: Linear | QuantLinear
    gate: Linear | QuantLinear
    up: Linear | QuantLinear
    down: Linear | QuantLinear
    gate_up: GateUp | None = None

    @classmethod
    def dense(
        cls, layer: DecoderLayerWeights, plan: PackPlan | None, *, fuse_mlp: bool = False
    ) -> LayerLinears:
        """The layer's full-precision projections (step 1 of the module)."""
        owner, gate, up = layer.owner, layer.gate, layer.up
        gate_up = None
        if fuse_mlp and gate.bias is None and fusable_gate_up(plan, gate.weight, up.weight):
            assert plan is not None
            gate_up = cached_gate_up(owner, gate.weight, up.weight, plan)
        mlp_plan = None if gate_up is not None else plan

        def linear(key: str, own_plan: PackPlan | None = plan) -> Linear:
            weights = layer.projection(key)
            return cached_linear(owner, key, weights.weight, weights.bias, own_plan)

        return cls(
            qkv=linear("qkv"),
            o_proj=linear("o_proj"),
            gate=linear("gate", mlp_plan),
            up=linear("up", mlp_plan),
            down=linear("down"),
            gate_up=gate_up,
        )


class Placement(Protocol):
    """Where a tensor-parallel rank's projections and embedding come from (parallel/layers.py):
    each takes the one-device op and gives the rank's op with its collective."""

    def row_parallel(self, linear: Linear) -> Linear: ...

    def lm_head(self, linear: Linear) -> Linear: ...

    def embedding(self, embed: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]: ...


@dataclass(frozen=True)
class ModelLinears:
    """What `build_linears` gives: every layer's projections, the LM head, the report."""

    layers: list[LayerLinears]
    lm_head: Linear | QuantLinear
    quantization: QuantizationReport


def build_linears(
    hf_model: PreTrainedModel,
    weights: ModelWeights,
    config: TorchBackendConfig,
    *,
    mode: str,
    plan: PackPlan | None,
    fuse_mlp: bool,
    placement: Placement | None = None,
) -> ModelLinears:
    """Every projection of `weights`, each with its final method (see the module).

    `mode` is the settled `--quantization` (quantization.resolve_mode).
    """
    dense = [LayerLinears.dense(layer, plan, fuse_mlp=fuse_mlp) for layer in weights.layers]
    head = cached_linear(weights.lm_head, "lm_head", weights.lm_head_weight, None, plan)
    if config.batch_invariant:
        _check_one_kernel(dense, head)
    ops, lm_head, report = quantize_linears(hf_model, config, mode, dense, head)
    layers = [
        dataclasses.replace(lin, **layer_ops) for lin, layer_ops in zip(dense, ops, strict=True)
    ]
    if placement is not None:
        layers = [
            dataclasses.replace(
                lin,
                o_proj=placement.row_parallel(_full_precision(lin.o_proj)),
                down=placement.row_parallel(_full_precision(lin.down)),
            )
            for lin in layers
        ]
        lm_head = placement.lm_head(_full_precision(lm_head))
    return ModelLinears(layers, lm_head, report)


def _full_precision(linear: Any) -> Linear:
    """`linear`, a full-precision `Linear`: ranks never get quantised copies (config.py)."""
    assert isinstance(linear, Linear), "tensor parallelism runs no quantised linears"
    return linear


def _check_one_kernel(layers: Sequence[LayerLinears], head: Linear) -> None:
    """`batch_invariant`: refuse where a linear kept no packed copy (it would take
    `F.linear`, whose sums may depend on the step's rows)."""
    for lin in layers:
        mlp = (lin.gate, lin.up) if lin.gate_up is None else ()  # else gate_up takes all
        ops = (lin.qkv, lin.o_proj, *mlp, lin.down)
        if not all(isinstance(op, Linear) and op.plan is not None for op in ops):
            raise ValueError("batch_invariant: a linear of this model has no packed copy")
    if head.plan is None:
        raise ValueError("batch_invariant: the LM head has no packed copy")
