"""The Llama family's HF module vocabulary, for code that meets such modules in any model.

The generic path (backends/torch/generic/) swaps Carousel's ops into HF modules that run
Llama's own code (Mistral's, Qwen2's and many other classes copy it); which children those
modules have, and under what names, is the Llama family's knowledge, so it is written here,
beside the family file, and nowhere else (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

#: sibling projections that read one input, by their standard names, and their fused key
SIBLINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("gate_up", ("gate_proj", "up_proj")),
)
#: a gated MLP's projections: gate, up, down
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: a decoder layer's two norms: before attention, before the MLP
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
#: a decoder layer's attention module
ATTENTION = "self_attn"
#: an RMSNorm's epsilon
NORM_EPS = "variance_epsilon"


def mlp_linears(mlp: Any) -> tuple[Any, Any, Any]:
    """`mlp`'s gate, up and down projections (None where it lacks one)."""
    gate, up, down = (getattr(mlp, name, None) for name in MLP_LINEARS)
    return gate, up, down


def layer_norms(layer: Any) -> tuple[Any, Any]:
    """`layer`'s input and post-attention norms (None where it lacks one)."""
    first, second = (getattr(layer, name, None) for name in LAYER_NORMS)
    return first, second


def layer_attention(layer: Any) -> Any:
    """`layer`'s attention module."""
    return getattr(layer, ATTENTION)


def norm_eps(norm: Any) -> Any:
    """`norm`'s epsilon (None where it has none)."""
    return getattr(norm, NORM_EPS, None)
