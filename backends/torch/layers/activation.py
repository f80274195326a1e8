"""The MLP's gate and up projections and its SiLU: `act_fn(gate(x)) * up(x)`, (N, I)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from backends.torch.layers.custom_op import CustomOp
from backends.torch.layers.linear import GateUp
from backends.torch.layers.quant_linear import QuantLinear

LinearOp = Callable[[torch.Tensor], torch.Tensor]  # a `Linear`, or a `QuantLinear` over one


class GateUpSilu(CustomOp):
    """The activated MLP input before `down`, from the layer's current gate/up linears.

    On CPU with Carousel's kernels: decode-sized inputs through one `GateUp` pass over the
    interleaved gate/up weight where one was packed (`fuse_mlp`), else the two linears and
    the `silu_mul` kernel. The kernels run only for a SiLU MLP (`act_is_silu`).
    """

    def __init__(
        self,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        kernels: ModuleType | None,
        *,
        act_is_silu: bool = True,
    ) -> None:
        self.act_fn, self.act_is_silu = act_fn, act_is_silu
        super().__init__(device, kernels)

    def supports_kernels(self) -> bool:
        return self.act_is_silu

    def __call__(
        self, x: torch.Tensor, gate: LinearOp, up: LinearOp, gate_up: GateUp | None
    ) -> torch.Tensor:
        out: torch.Tensor = self._forward(x, gate, up, gate_up)
        return out

    def forward_native(
        self, x: torch.Tensor, gate: LinearOp, up: LinearOp, gate_up: GateUp | None
    ) -> torch.Tensor:
        return self.act_fn(gate(x)) * up(x)

    def forward_cpu(
        self, x: torch.Tensor, gate: LinearOp, up: LinearOp, gate_up: GateUp | None
    ) -> torch.Tensor:
        assert self.kernels is not None
        quantised = isinstance(gate, QuantLinear) and gate.takes(x)
        if gate_up is not None and gate_up.takes(x) and not quantised:
            return gate_up(x)
        out: torch.Tensor = self.kernels.silu_mul(gate(x), up(x))
        return out
