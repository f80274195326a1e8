"""The eager stack: every decoder layer op by op, from Python (it runs any step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.torch.attention.base import AttentionMetadata
from backends.torch.attention.rotary import RotaryWriteKV
from backends.torch.layers.activation import GateUpSilu
from backends.torch.layers.layernorm import RMSNorm
from backends.torch.linears import LayerLinears
from backends.torch.stacks import Rope


@dataclass(frozen=True)
class LayerOps:
    """One decoder layer's ops, each with its implementation chosen at load."""

    input_norm: RMSNorm
    post_norm: RMSNorm
    rotary: RotaryWriteKV
    mlp_act: GateUpSilu
    linears: LayerLinears


class EagerStack:
    """Each residual add folded into the norm after it; `hidden` (fresh from the embedding)
    is the residual stream, updated in place."""

    name = "eager"

    def __init__(self, layers: Sequence[LayerOps], attention: Any) -> None:
        self.layers = list(layers)
        self.attention = attention

    def __call__(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        layers = self.layers
        x = layers[0].input_norm(hidden)
        for index, ops in enumerate(layers):
            x = ops.post_norm(self._attention(index, ops, x, rope, meta), hidden)
            lin = ops.linears
            mlp_out = lin.down(ops.mlp_act(x, lin.gate, lin.up, lin.gate_up))
            if index + 1 < len(layers):
                x = layers[index + 1].input_norm(mlp_out, hidden)
            else:
                hidden += mlp_out
        return hidden

    def _attention(
        self, index: int, ops: LayerOps, x: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Layer `index`'s attention block output (N, H), K/V stored in the cache."""
        n = x.shape[0]
        qkv = ops.linears.qkv(x)  # (N, q + 2 * kv)
        q, k, v = ops.rotary(qkv, *rope, meta)
        out = self.attention.attend(index, q, k, v, meta)  # (N, nh, hd)
        return ops.linears.o_proj(out.view(n, -1))  # (N, H)
