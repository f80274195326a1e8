"""RMS norm with the residual add folded in (HF's LlamaRMSNorm kind of module)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from backends.torch.layers.custom_op import CustomOp

#: the norm modules whose formula is the kernels' `rms_norm` (weight * x / rms(x))
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class RMSNorm(CustomOp):
    """`norm(x)`; with `residual`: `residual += x` (in place), then `norm(residual)`.

    The CPU kernels do both in one pass per row, rounding where the HF module rounds.
    """

    def __init__(self, module: nn.Module, device: torch.device, kernels: ModuleType | None) -> None:
        self.module = module
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = weight
        self.eps = float(getattr(module, "variance_epsilon", 0.0))
        super().__init__(device, kernels)

    def supports_kernels(self) -> bool:
        return type(self.module).__name__ in RMS_NORMS

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
