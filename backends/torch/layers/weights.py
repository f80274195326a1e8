"""A projection's weights, as the layers take them (the family files in models/ build them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearWeights:
    """One projection: `y = x @ weight.T + bias`."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None
