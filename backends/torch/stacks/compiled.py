"""The compiled stack (`--compile`): every layer through compiled_layer.py's one compiled
function.

The graph calls the model's `Linear`s through `carousel::linear` (compiled_ops.py), so the
linears it runs are registered here, once, and are full precision (`--compile` runs no
quantised linears: config.py). Its gate and up run one by one (no `GateUp`: linears.py builds
none for it).
NOTE: compiled_layer and compiled_ops are imported only inside: importing them imports Dynamo
and Inductor, whose threads an eager server must not carry (backends/torch/runner/device_thread.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.torch.attention.base import AttentionMetadata, AttentionSpec
from backends.torch.layers.linear import Linear
from backends.torch.linears import LayerLinears
from backends.torch.models import DecoderLayerWeights
from backends.torch.stacks import Rope, inductor


def compilable(specs: Sequence[AttentionSpec]) -> bool:
    """Whether the compiled layer (compiled_layer.py) can run this model here; logs why not."""
    if not inductor.compiler_available():
        inductor.log.warning("no C++ compiler for Inductor: the forward runs eager")
        return False
    if len({(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs}) != 1:
        inductor.log.warning("layers of different shapes: the forward runs eager")
        return False
    return True


class CompiledStack:
    """Every decoder layer through the one compiled graph, weights as inputs."""

    name = "compiled"

    def __init__(
        self,
        layers: Sequence[DecoderLayerWeights],
        linears: Sequence[LayerLinears],
        attention: object,
    ) -> None:
        from backends.torch.stacks import compiled_layer

        inductor.configure()
        self.attention = attention
        self._layer_index = [torch.tensor(i) for i in range(len(layers))]
        self._layer_weights = [
            _weights_of(layer, lin) for layer, lin in zip(layers, linears, strict=True)
        ]
        spec = layers[0].spec
        eps = layers[0].input_norm.eps
        self._layer_shape = compiled_layer.LayerShape(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, eps
        )

    def __call__(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        from backends.torch.stacks import compiled_layer, compiled_ops

        cos, sin = rope
        with compiled_ops.forward_context(self.attention, meta):
            for index, weights in zip(self._layer_index, self._layer_weights, strict=True):
                hidden = compiled_layer.compiled_decoder_layer(
                    hidden, cos, sin, index, weights, self._layer_shape
                )
        return hidden


def _weights_of(layer: DecoderLayerWeights, lin: LayerLinears) -> tuple[torch.Tensor | None, ...]:
    """compiled_layer.py's `weights` tuple of one layer (its linears registered for the graph)."""
    from backends.torch.stacks import compiled_ops

    for linear in (lin.qkv, lin.o_proj, lin.gate, lin.up, lin.down):
        assert isinstance(linear, Linear), "--compile runs no quantised linears (config.py)"
        compiled_ops.register_linear(linear)
    assert isinstance(lin.qkv, Linear) and isinstance(lin.o_proj, Linear)
    assert isinstance(lin.gate, Linear) and isinstance(lin.up, Linear)
    assert isinstance(lin.down, Linear)
    q_norm, k_norm = (None, None) if layer.head_norms is None else layer.head_norms
    return (
        lin.qkv.weight, lin.qkv.bias, lin.o_proj.weight, lin.gate.weight, lin.up.weight,
        lin.down.weight, layer.input_norm.weight, layer.post_norm.weight,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
    )  # fmt: skip
