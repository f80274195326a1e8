"""The attention's residual add folded into the next norm, for Llama-code decoder layers.

A decoder layer whose class runs Llama's decoder-layer code (`same_code`: input norm,
attention, `residual + attention`, post-attention norm, MLP, `residual + mlp`; Mistral's,
Qwen2's, Qwen3's, OLMoE's and 60-odd other copies) and whose two norms are Llama-formula
RMSNorms (norms.py) runs, during a step, the same sequence with the first add and the
post-attention norm in one CPU-kernel pass (`add_rms_norm`, as the native path's stacks do):
the attention's output becomes the residual stream, `attention + residual` (the same sum),
and the MLP's output is added to it in place. The layer's input is never written.

A call the fold cannot take runs the layer's own forward: positional arguments beyond the
hidden states, a dtype the kernels lack or other than the norm's, or an attention output that
is not a fresh contiguous tensor of the input's shape (one it may write into).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from backends.torch.generic.norms import llama_norm
from backends.torch.generic.swaps import StepSwaps, own_forward, same_code
from backends.torch.models.llama_modules import layer_attention, layer_norms, norm_eps


def foldable(layer: nn.Module) -> bool:
    """Whether `layer` runs Llama's decoder-layer code over two Llama-formula norms."""
    if not same_code(type(layer), "forward", LlamaDecoderLayer.forward) or not own_forward(layer):
        return False
    norms = layer_norms(layer)
    return all(isinstance(n, nn.Module) and llama_norm(n) for n in norms) and not _hooked(norms[1])


def _hooked(module: Any) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def folded_forward(
    layer: Any, kernels: ModuleType, dtypes: tuple[torch.dtype, ...]
) -> Callable[..., torch.Tensor]:
    """`layer`'s step-time forward (see the module)."""
    own = type(layer).forward.__get__(layer)
    first, post = layer_norms(layer)
    attention = layer_attention(layer)
    eps = float(norm_eps(post))

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = post.weight
        if args or hidden_states.dtype != weight.dtype or hidden_states.dtype not in dtypes:
            whole: torch.Tensor = own(hidden_states, *args, **kwargs)
            return whole
        x = first(hidden_states)
        attn, _ = attention(hidden_states=x, **kwargs)
        if not _writable(attn, hidden_states, x):
            residual = hidden_states + attn
            return residual + layer.mlp(post(residual))
        width = hidden_states.shape[-1]
        stream = attn.view(-1, width)  # becomes `attention + residual`, in place
        inputs = hidden_states.reshape(-1, width).contiguous()
        normed = kernels.add_rms_norm(stream, inputs, weight, eps)
        out: torch.Tensor = layer.mlp(normed.view(hidden_states.shape))
        return stream.view(hidden_states.shape).add_(out)

    return forward


def _writable(attn: Any, hidden_states: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `attn` is a contiguous tensor like `hidden_states` sharing memory with neither
    input (so writing the residual stream into it changes nothing else the layer reads)."""
    if not isinstance(attn, torch.Tensor) or not attn.is_contiguous():
        return False
    if attn.shape != hidden_states.shape or attn.dtype != hidden_states.dtype:
        return False
    ours = attn.untyped_storage().data_ptr()
    return all(ours != t.untyped_storage().data_ptr() for t in (hidden_states, x))


def fold_residuals(
    model: nn.Module, kernels: ModuleType, dtypes: tuple[torch.dtype, ...], swaps: StepSwaps
) -> list[nn.Module]:
    """Every foldable decoder layer of `model` (see `foldable`), put in `swaps`."""
    layers = [m for m in model.modules() if foldable(m)]
    for layer in layers:
        swaps.put(layer, folded_forward(layer, kernels, dtypes))
    return layers
