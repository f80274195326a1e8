"""Llama-formula RMSNorms through the CPU kernels' `rms_norm`, one pass per row.

HF's RMSNorm is about eight torch ops and an fp32 copy of its input per call (61 calls a
SmolLM2 step). A module whose class runs Llama's RMSNorm code (`same_code`:
`weight * (x.float() * rsqrt(mean(x^2) + variance_epsilon)).to(dtype)`, which 140-odd
transformers classes copy) is computed during a step by the kernel the native path runs for the
same norms (cpu_kernels, rounding where the HF module rounds), over its last dimension. Gemma's
`(1 + w)` norms and any other formula run their own code (their code differs). A call the
kernel cannot take (another dtype than the weight's, one the kernels lack, not on the CPU)
runs the module's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from backends.torch.generic.swaps import StepSwaps, own_forward, same_code
from backends.torch.models.llama_modules import norm_eps


def llama_norm(module: nn.Module) -> bool:
    """Whether `module` computes Llama's RMSNorm (see the module)."""
    weight = getattr(module, "weight", None)
    return (
        same_code(type(module), "forward", LlamaRMSNorm.forward)
        and own_forward(module)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(norm_eps(module), float | int)
    )


def kernel_norm_forward(
    module: Any, kernels: ModuleType, dtypes: tuple[torch.dtype, ...]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s step-time forward (see the module)."""
    own = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (
            x.dtype != weight.dtype
            or x.dtype not in dtypes
            or x.device.type != "cpu"
            or not weight.is_contiguous()
        ):
            fallback: torch.Tensor = own(x)
            return fallback
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out: torch.Tensor = kernels.rms_norm(rows, weight, float(norm_eps(module)))
        return out.view(x.shape)

    return forward


def native_norms(
    model: nn.Module, kernels: ModuleType, dtypes: tuple[torch.dtype, ...], swaps: StepSwaps
) -> list[nn.Module]:
    """Every Llama-formula RMSNorm of `model` through `kernels.rms_norm`, put in `swaps`."""
    norms = [m for m in model.modules() if llama_norm(m)]
    for norm in norms:
        swaps.put(norm, kernel_norm_forward(norm, kernels, dtypes))
    return norms
