"""Llama-formula RMSNorms through the CPU kernels' `rms_norm`, one pass per row.

HF's RMSNorm is about eight torch ops and an fp32 copy of its input per call (61 calls a
SmolLM2 step). A module whose class runs Llama's RMSNorm code (`same_code`:
`weight * (x.float() * rsqrt(mean(x^2) + variance_epsilon)).to(dtype)`, which 140-odd
transformers classes copy) is computed during a step by the kernel the native path runs for the
same norms (cpu_kernels, rounding where the HF module rounds), over its last dimension. A call
the kernel cannot take (another dtype than the weight's, one the kernels lack, not on the CPU)
runs the module's own forward.

Gemma's `(1 + w)` norms (`offset_norm`: `(norm(x.float()) * (1 + w.float())).type_as(x)`,
GemmaRMSNorm's code, which Gemma 2 and 3, VaultGemma, Qwen3-Next and a dozen others copy; six a
Gemma 3 layer) compute the whole formula in fp32 and round once: the same kernel over the fp32
copy of the rows, with `1 + w` in fp32 as its weight, is that formula (in fp32 the Llama
rounding step is none), one op and two casts instead of about ten ops. Only the mean's
summation order differs from HF's. Gemma 3 270M, bf16, [64, 640] rows on the 2-core Zen 4:
93 -> 35 us a norm, 109 norms a step.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
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


def offset_norm(module: nn.Module) -> bool:
    """Whether `module` computes Gemma's `(1 + w)` RMSNorm (see the module)."""
    weight = getattr(module, "weight", None)
    return (
        same_code(type(module), "forward", GemmaRMSNorm.forward)
        and same_code(type(module), "_norm", GemmaRMSNorm._norm)
        and own_forward(module)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "eps", None), float | int)
    )


def offset_norm_forward(module: Any, kernels: ModuleType) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s step-time forward: the kernel over fp32 rows, `1 + w` its weight (the module)."""
    own = type(module).forward.__get__(module)
    made: dict[str, Any] = {}  # the weight `1 + w` was made from, its state, and `1 + w`

    def one_plus_w(weight: torch.Tensor) -> torch.Tensor:
        # a new weight, a cast (new data) or an in-place load (a new version) changes it
        state = (weight.data_ptr(), -1 if weight.is_inference() else weight._version, weight.dtype)
        if made.get("weight") is not weight or made["state"] != state:
            made.update(weight=weight, state=state, value=(1.0 + weight.detach().float()))
        value: torch.Tensor = made["value"]
        return value

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (
            x.device.type != "cpu"
            or x.dtype not in _OFFSET_DTYPES
            or weight.shape != x.shape[-1:]  # a weight HF would broadcast
        ):
            fallback: torch.Tensor = own(x)
            return fallback
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        out: torch.Tensor = kernels.rms_norm(rows, one_plus_w(weight), float(module.eps))
        return out.to(x.dtype).view(x.shape)

    return forward


_OFFSET_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def offset_norms(model: nn.Module, kernels: ModuleType, swaps: StepSwaps) -> list[nn.Module]:
    """Every `(1 + w)` RMSNorm of `model` through `kernels.rms_norm` in fp32, put in `swaps`."""
    norms = [m for m in model.modules() if offset_norm(m)]
    for norm in norms:
        swaps.put(norm, offset_norm_forward(norm, kernels))
    return norms
