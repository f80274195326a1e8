"""The HF model's `nn.Linear`s through prepacked weights, for the generic path's steps only.

On a CPU the native path's linears multiply through a prepacked copy of each weight (Carousel's
kernels' or oneDNN's, layers/linear.py) for decode-sized steps; `F.linear` reorders the weight
on every call. `PackedLinears` builds the same packed `Linear` for every plain `nn.Linear` of
the HF model (cached on the module, so arms sharing the model share the copies) and swaps it in
as the module's forward for the duration of a step, then gives the module back: the same HF
model may run `generate`, or serve a native arm, between two steps. A step's rows outside the
plan's window take `F.linear` as before. SmolLM2-135M, bf16, decode step at B = 64 on the
2-core CPU (scripts/step_ab.py, one interleaved run): 88.8 ms without it, 73.0 ms with it,
against the native path's 40.0 ms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from backends.torch.layers.linear import Linear, PackPlan, cached_linear

_KEY = "generic"


def _flat(linear: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` over any leading dims: the packed kernels take a (rows, in) matrix."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], linear.out_features)

    return forward


class PackedLinears:
    """Every plain `nn.Linear` of a model with its packed `Linear` (see the module)."""

    def __init__(self, model: nn.Module, plan: PackPlan) -> None:
        linears = [
            (module, cached_linear(module, _KEY, module.weight, module.bias, plan))
            for module in model.modules()
            if type(module) is nn.Linear
        ]
        self.swaps = [(module, _flat(linear)) for module, linear in linears]
        copies = {id(lin.packed): lin.packed for _, lin in linears if lin.packed is not None}
        #: the packed copies' bytes (tied weights packed once per module that uses them)
        self.packed_bytes = sum(c.numel() * c.element_size() for c in copies.values())

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The packed forwards for the block; the modules' own afterwards."""
        for module, forward in self.swaps:
            module.forward = forward  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            for module, _ in self.swaps:
                del module.forward
