"""The HF model's `nn.Linear`s through prepacked weights, for the generic path's steps only.

On a CPU the native path's linears multiply through a prepacked copy of each weight (Carousel's
kernels' or oneDNN's, layers/linear.py) for decode-sized steps; `F.linear` reorders the weight
on every call. `PackedLinears` builds the same packed `Linear` for every plain `nn.Linear` of
the HF model that no fused swap computes (fusion.py: those run as fused siblings or inside a
fused MLP), cached on the module, so arms sharing the model share the copies, and puts it
in the step's swaps (swaps.py) as the module's forward: the same HF model may run `generate`,
or serve a native arm, between two steps. A step's rows outside the plan's window take
`F.linear` as before. SmolLM2-135M, bf16, decode step at B = 64 on the 2-core CPU
(scripts/step_ab.py, one interleaved run, before fusion): 88.8 ms without it, 73.0 ms with
it, against the native path's 40.0 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from backends.torch.generic.swaps import StepSwaps, own_forward
from backends.torch.layers.linear import Linear, PackPlan, cached_linear

_KEY = "generic"


def _flat(linear: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` over any leading dims: the packed kernels take a (rows, in) matrix."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], linear.out_features)

    return forward


class PackedLinears:
    """Every plain `nn.Linear` of a model but `skip` with its packed `Linear` (see the module)."""

    def __init__(self, model: nn.Module, plan: PackPlan, skip: Collection[int] = ()) -> None:
        self.linears = [
            (module, cached_linear(module, _KEY, module.weight, module.bias, plan))
            for module in model.modules()
            if type(module) is nn.Linear and id(module) not in skip and own_forward(module)
        ]
        self.swaps = [(module, _flat(linear)) for module, linear in self.linears]

    def put_into(self, swaps: StepSwaps) -> None:
        for module, forward in self.swaps:
            swaps.put(module, forward)

    def copies(self) -> list[torch.Tensor]:
        """The packed copies (tied weights packed once per module that uses them)."""
        return [lin.packed for _, lin in self.linears if lin.packed is not None]
