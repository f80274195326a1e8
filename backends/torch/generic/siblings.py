"""Sibling projections (q/k/v, gate/up) as one matmul over their concatenated weight.

A transformers attention module calls `q_proj`, `k_proj` and `v_proj` on the same hidden
states, an MLP `gate_proj` and `up_proj`: three (two) matmuls where one over the rows of all
would do (layers/fused.py). Here, for the modules found under those standard names (plain
`nn.Linear`s of one parent, one input width, dtype and device, all with a bias or none),
their weights become row slices of one fused tensor (`fuse_rows`: no second copy, the HF
modules compute what they did) and during a step the first member called on an input
computes the fused product, keeps it, and returns its own slice; the others, called on that
very tensor (`is`), return theirs (views) without a matmul. A member called on any other
tensor, or a second time on the same one, computes the fused product again: whatever order
and inputs the modeling code uses, each call returns its own projection of its own input.

NOTE: the kept product is matched by the input's identity, not its contents: a parent that
wrote into its hidden states in place between two sibling calls would get the product of the
unwritten ones. No transformers attention or MLP does (they project one unchanged tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from backends.torch.generic.swaps import StepSwaps, own_forward
from backends.torch.layers.fused import fuse_rows
from backends.torch.layers.linear import Linear, PackPlan, cached_linear

_KEY = "generic_"  # the fused linear's key among the parent's cached linears


def sibling_sets(model: nn.Module, names: Sequence[str]) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """Every parent in `model` whose children `names` are fusable `nn.Linear`s (see the module),
    with them in that order."""
    found = []
    for parent in model.modules():
        members = [getattr(parent, name, None) for name in names]
        linears = [m for m in members if type(m) is nn.Linear]
        if len(linears) == len(names) and _fusable(linears):
            found.append((parent, linears))
    return found


def _fusable(linears: Sequence[nn.Linear]) -> bool:
    first = linears[0]
    return len({id(m) for m in linears}) == len(linears) and all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        and own_forward(m)
        for m in linears
    )


class SiblingGroup:
    """One parent's siblings over one fused `Linear` (see the module)."""

    def __init__(self, members: Sequence[nn.Linear], fused: Linear) -> None:
        self.fused = fused
        self.widths = [m.out_features for m in members]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served: set[int] = set()
        #: how many fused products were computed (each serves every member once)
        self.products = 0

    def forward_of(self, index: int) -> _Member:
        return _Member(self, index)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s projection of `x`: its slice of the fused product."""
        if x is not self._input or index in self._served:
            flat = self.fused(x.reshape(-1, x.shape[-1]))
            out = flat.view(*x.shape[:-1], flat.shape[-1])
            self._input, self._outputs, self._served = x, out.split(self.widths, dim=-1), set()
            self.products += 1
        self._served.add(index)
        out = self._outputs[index]
        if len(self._served) == len(self.widths):
            self.clear()
        return out

    def clear(self) -> None:
        """Let go of the kept input and product (after each step)."""
        self._input, self._outputs, self._served = None, (), set()


class _Member:
    """A sibling's step-time forward: `group.take(index, x)`."""

    def __init__(self, group: SiblingGroup, index: int) -> None:
        self.group, self.index = group, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.take(self.index, x)


def fuse_siblings(
    parent: nn.Module,
    key: str,
    members: Sequence[nn.Linear],
    plan: PackPlan | None,
    swaps: StepSwaps,
) -> SiblingGroup:
    """`members` (children of `parent`) as one `SiblingGroup`, its forwards put in `swaps`."""
    weights = fuse_rows(parent, key, members)
    fused = cached_linear(parent, _KEY + key, weights.weight, weights.bias, plan)
    group = SiblingGroup(members, fused)
    for index, member in enumerate(members):
        swaps.put(member, group.forward_of(index))
    swaps.after_step(group.clear)
    return group
