"""RMS norm with the residual add folded in (HF's LlamaRMSNorm kind of module)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from backends.torch.layers.custom_op import CustomOp


@dataclass(frozen=True)
class NormWeights:
    """One norm: the HF module (the reference forward) and what the kernels need of it
    (a family file in models/ builds it)."""

    module: nn.Module
    weight: torch.Tensor
    eps: float
    #: whether the module computes `weight * (x / rms(x))` rounding as Carousel's `rms_norm`
    #: kernel does (HF's Llama-style RMSNorm); else only the module itself runs it
    kernel_formula: bool


#: a layer's per-head RMSNorms of Q and K (Qwen3's)
HeadNorms = tuple[NormWeights, NormWeights]


class RMSNorm(CustomOp):
    """`norm(x)`; with `residual`: `residual += x` (in place), then `norm(residual)`.

    The CPU kernels do both in one pass per row, rounding where the HF module rounds.
    """

    def __init__(self, norm: NormWeights, device: torch.device, kernels: ModuleType | None) -> None:
        self.norm = norm
        self.module, self.weight, self.eps = norm.module, norm.weight, norm.eps
        super().__init__(device, kernels)

    def supports_kernels(self) -> bool:
        return self.norm.kernel_formula

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self._forward(x, residual)
        return out

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is not None:
            residual += x
            x = residual
        out: torch.Tensor = self.module(x)
        return out

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.kernels is not None
        if residual is None:
            out: torch.Tensor = self.kernels.rms_norm(x, self.weight, self.eps)
        else:
            out = self.kernels.add_rms_norm(residual, x, self.weight, self.eps)
        return out
