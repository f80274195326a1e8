"""What a family file declares: the per-layer weights record, and the family's interface.

The record holds tensors and HF modules by role (`qkv`, `o_proj`, `gate`, `up`, `down`, the
norms), never by HF name, so the eager ops, the compiled layer function and the native decode
stack are all fed from one place, and a new architecture is one new family file.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from backends.torch.attention.base import AttentionSpec
from backends.torch.layers.layernorm import HeadNorms, NormWeights
from backends.torch.layers.weights import LinearWeights

#: a layer's projections, in the forward's order (Carousel's names, the C++ stack's too)
PROJECTIONS = ("qkv", "o_proj", "gate", "up", "down")


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer by role (see the module)."""

    index: int
    #: the HF layer module: packed and quantised copies are cached on it, so arms sharing one
    #: loaded model share them
    owner: nn.Module
    spec: AttentionSpec
    qkv: LinearWeights  # q, k and v rows fused into one weight (layers/fused.py)
    o_proj: LinearWeights
    gate: LinearWeights
    up: LinearWeights
    down: LinearWeights
    input_norm: NormWeights
    post_norm: NormWeights
    #: per-head RMSNorms of Q and K before rotary (Qwen3), or None
    head_norms: HeadNorms | None
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    act_is_silu: bool
    #: projection -> the checkpoint's module names it is made of (qkv: three)
    checkpoint_names: Mapping[str, tuple[str, ...]]

    def projection(self, key: str) -> LinearWeights:
        """The projection named `key` (one of `PROJECTIONS`)."""
        weights: LinearWeights = getattr(self, key)
        return weights


@dataclass(frozen=True)
class ModelWeights:
    """A loaded model by role: embedding, rotary, decoder layers, final norm, LM head."""

    family: str
    embed: nn.Module  # token ids -> (N, H)
    rotary: nn.Module  # HF's rotary embedding: (hidden, positions) -> (cos, sin)
    layers: tuple[DecoderLayerWeights, ...]
    final_norm: NormWeights
    lm_head: nn.Module  # its `weight` (V, H)
    #: whether the LM head's weight is the embedding's
    tied: bool
    #: the checkpoint names the LM head's weight may be stored under, in order of preference
    lm_head_names: tuple[str, ...]
    hidden_act: str | None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight


#: (checkpoint tensor name pattern, dim, the shard plan's range it is cut by)
TPRule = tuple[re.Pattern[str], int, str]


class ArchitectureFamily(abc.ABC):
    """A family of HF architectures sharing one decoder layer (one file in models/)."""

    name: ClassVar[str]
    #: HF causal-LM class names -> their `model_type`
    architectures: ClassVar[Mapping[str, str]]
    #: llama.cpp's per-layer tensor names -> the HF module names transformers converts them to
    gguf_layer_names: ClassVar[Mapping[str, str]]
    #: llama.cpp's top-level tensor names -> HF module names
    gguf_top_names: ClassVar[Mapping[str, str]]
    #: llama.cpp's per-layer names whose rows its converter permuted for rotary, by GGUF arch
    #: (Q's name first, then K's)
    gguf_rotary_permuted: ClassVar[Mapping[str, tuple[str, ...]]]
    #: how each checkpoint tensor is cut for tensor parallelism (parallel/shard.py)
    tp_rules: ClassVar[tuple[TPRule, ...]]
    #: checkpoint tensors every rank holds whole
    tp_replicated: ClassVar[re.Pattern[str]]
    #: the checkpoint name of decoder layer `i`'s module, `str.format`ted with `i`
    layer_prefix: ClassVar[str]

    @abc.abstractmethod
    def weights(self, hf_model: Any) -> ModelWeights:
        """`hf_model` by role (the only place its attribute names are read)."""

    def gguf_hf_name(self, layer: int, gguf_name: str) -> str | None:
        """The HF module a per-layer GGUF tensor becomes, or None for none of our linears."""
        name = self.gguf_layer_names.get(gguf_name)
        return None if name is None else self.layer_prefix.format(layer) + name
