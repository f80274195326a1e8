"""A gated SiLU MLP's `act_fn(gate_proj(x)) * up_proj(x)` as one kernel call (`GateUp`).

For an MLP whose class runs Llama's MLP code (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`,
`same_code`: Mistral's, Qwen2's, Qwen3's, OLMo's and the other copies) with a SiLU `act_fn` and
bias-free gate and up projections, during a step the MLP's forward is Carousel's: gate, up
and the SiLU in one pass of the CPU kernels' `linear_silu_mul` over the interleaved gate/up
weight (layers/linear.py `GateUp`, rounding as the HF expression does, as on the native
path), then `down_proj` called as the module (its own step-time forward and hooks). Rows
outside the kernel's window (a long prefill) run the MLP's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from backends.torch.generic.swaps import StepSwaps, own_forward, same_code
from backends.torch.layers.linear import GateUp, PackPlan, cached_gate_up, fusable_gate_up
from backends.torch.models.llama_modules import mlp_linears

_SILU = (SiLUActivation, nn.SiLU)


def silu_mlp(module: nn.Module, plan: PackPlan | None) -> bool:
    """Whether `module` is an MLP the `GateUp` kernel computes under `plan`."""
    if not same_code(type(module), "forward", LlamaMLP.forward) or not own_forward(module):
        return False
    gate, up, down = mlp_linears(module)
    act = getattr(module, "act_fn", None)
    return (
        all(type(m) is nn.Linear for m in (gate, up, down))
        and type(act) in _SILU
        and act is not None
        and own_forward(act)
        and gate.bias is None  # type: ignore[union-attr]
        and up.bias is None  # type: ignore[union-attr]
        and fusable_gate_up(plan, gate.weight, up.weight)  # type: ignore[union-attr]
    )


def gate_up_forward(module: Any, gate_up: GateUp) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s step-time forward (see the module)."""
    own = type(module).forward.__get__(module)
    _, _, down = mlp_linears(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not gate_up.takes(rows):
            out: torch.Tensor = own(x)
            return out
        act = gate_up(rows)
        result: torch.Tensor = down(act.view(*x.shape[:-1], act.shape[-1]))
        return result

    return forward


def fuse_mlps(
    model: nn.Module, plan: PackPlan | None, swaps: StepSwaps
) -> list[tuple[nn.Module, GateUp]]:
    """Every SiLU MLP of `model` (see `silu_mlp`) through its `GateUp`, put in `swaps`."""
    fused = []
    mlp: Any
    for mlp in [m for m in model.modules() if silu_mlp(m, plan)]:
        assert plan is not None  # see fusable_gate_up
        gate, up, _ = mlp_linears(mlp)
        gate_up = cached_gate_up(mlp, gate.weight, up.weight, plan)
        swaps.put(mlp, gate_up_forward(mlp, gate_up))
        fused.append((mlp, gate_up))
    return fused
