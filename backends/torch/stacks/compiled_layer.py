"""One decoder layer as a plain function of its weights, for torch.compile to fuse.

The eager forward (model.py) calls the HF modules themselves. This is the same math
(Llama/Mistral/Qwen2/Qwen3: RMSNorm, SiLU-gated MLP, rotary, Qwen3's per-head Q/K norms)
written over tensors instead of modules, so that one compiled graph serves every layer: the
weights are arguments, and layers differ only in them. Inductor turns the norms, rotary,
activation and residual adds into a few fused C++ kernels (no fp32 copies of the
activations, no `cat`, no temporaries between them); the matmuls and attention stay opaque
ops (compiled_ops.py).

`TOKENS` names the one dynamic size: the number of scheduled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.torch.stacks import compiled_ops as ops

TOKENS = "tokens"


@dataclass(frozen=True)
class LayerShape:
    """What is the same in every layer (compile-time constants of the graph)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, round to the input dtype, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding: `x * cos + rotate_half(x) * sin` over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decoder_layer(
    hidden: torch.Tensor,  # (N, H) the residual stream
    cos: torch.Tensor,  # (N, 1, hd)
    sin: torch.Tensor,
    layer: torch.Tensor,  # () int64: the layer index, for the attention op
    weights: tuple[torch.Tensor | None, ...],
    shape: LayerShape,
) -> torch.Tensor:
    """The residual stream after one decoder layer, (N, H).

    `weights`: qkv, qkv bias, o_proj, gate, up, down, input norm, post-attention norm,
    q_norm, k_norm (biases and Qwen3's per-head norms None where the model has none).
    """
    qkv_w, qkv_b, o_w, gate_w, up_w, down_w, ln1, ln2, q_norm, k_norm = weights
    assert qkv_w is not None and o_w is not None and gate_w is not None
    assert up_w is not None and down_w is not None and ln1 is not None and ln2 is not None
    n, nh, nkv, hd = hidden.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = ops.linear(rms_norm(hidden, ln1, shape.eps), qkv_w, qkv_b)  # (N, (nh + 2 nkv) hd)
    q = qkv[:, : nh * hd].view(n, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(n, nkv, hd)
    if q_norm is not None and k_norm is not None:  # Qwen3: RMSNorm per head before rotary
        q, k = rms_norm(q, q_norm, shape.eps), rms_norm(k, k_norm, shape.eps)
    attn = ops.attention(rotary(q, cos, sin), rotary(k, cos, sin), v, layer)  # (N, nh, hd)
    hidden = hidden + ops.linear(attn.view(n, nh * hd), o_w, None)
    x = rms_norm(hidden, ln2, shape.eps)
    mlp = F.silu(ops.linear(x, gate_w, None)) * ops.linear(x, up_w, None)  # (N, I)
    return hidden + ops.linear(mlp, down_w, None)


compiled_decoder_layer = torch.compile(decoder_layer, dynamic=True, fullgraph=True)
