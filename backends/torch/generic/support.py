"""Which models the generic path runs, and which path (`--model-impl`) a model takes.

A model is refused here from its config and its class alone, before any weight is read, in one
line naming the class and the reason: a class that does not route attention through
transformers' `AttentionInterface`, an encoder-decoder, a model that keeps state in HF's cache
object (SSM and linear-attention hybrids, cross-attention, K/V shared between layers), a layer
kind other than full or sliding attention, and RoPE whose frequencies depend on the largest
position of the whole packed batch (`dynamic`, `longrope`: one long request would change every
other request's rotary; refused on the native path too, which runs the same rotary module).
What only a forward shows (an attention call with sinks or a position bias) is refused by the
probe (probe.py), still before the KV cache is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.auto_factory import _get_model_class

from backends.torch.config import AUTO, CAROUSEL, TRANSFORMERS
from backends.torch.models import check_architecture, supported_architectures

#: `model_type`s that keep per-sequence state in HF's cache object besides attention K/V (SSM,
#: linear attention, convolutions, cross-attention, K/V shared between layers)
CACHE_STATE_MODEL_TYPES = frozenset({
    "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "gemma3n", "gemma3n_text",
    "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "mamba", "mamba2",
    "minimax", "mllama", "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm",
    "zamba", "zamba2",
})  # fmt: skip
#: `model_type`s whose attention takes inputs our backends have no place for (GPT-OSS's sinks)
ATTENTION_EXTRAS_MODEL_TYPES = frozenset({"gpt_oss"})
#: the layer kinds of `layer_types` whose attention our backends compute
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: RoPE types whose frequencies are chosen from the largest position in the batch
BATCH_COUPLED_ROPE = frozenset({"dynamic", "longrope"})


def resolve_model_impl(requested: str, architecture: str) -> str:
    """`--model-impl`'s path for `architecture`: `auto` is `carousel` for the families of
    models/ and `transformers` for every other class."""
    if requested != AUTO:
        return requested
    return CAROUSEL if architecture in supported_architectures() else TRANSFORMERS


def causal_lm_class(config: PretrainedConfig) -> type[Any] | None:
    """The transformers causal-LM class `config` builds (None where it has none)."""
    try:
        cls: type[Any] = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except KeyError:
        return None
    return cls


def check_model(
    config: PretrainedConfig,
    architecture: str,
    model_impl: str,
    model_class: type[Any] | None = None,
) -> str:
    """The path `architecture` (built from `config`; `model_class`: the class where it is built
    already) takes under `model_impl`, after refusing (ValueError, one line) what that path
    cannot run; reads no weight."""
    impl = resolve_model_impl(model_impl, architecture)
    if impl == CAROUSEL:
        check_architecture(architecture)
        # NOTE: the native path runs HF's rotary module over the packed positions too
        reason = why_batch_coupled(config)
        if reason is not None:
            raise ValueError(f"{architecture} cannot run on the native path: {reason}")
        return impl
    model_class = model_class or causal_lm_class(config)
    reason = why_unsupported(model_class, config)
    if reason is not None:
        name = architecture if model_class is None else model_class.__name__
        raise ValueError(f"{name} cannot run on the generic (transformers) path: {reason}")
    return impl


def why_unsupported(model_class: type[Any] | None, config: PretrainedConfig) -> str | None:
    """Why the generic path cannot run `model_class` (None: transformers has no causal-LM
    class for `config`) with `config`, or None where it can."""
    model_type = str(getattr(config, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; only decoder-only models run here"
    if model_class is None:
        return f"transformers has no causal-LM class for a {type(config).__name__}"
    if model_type in CACHE_STATE_MODEL_TYPES:
        return (
            f"{model_type} keeps per-sequence state in transformers' cache object (recurrent, "
            "linear-attention, cross-attention or shared-K/V layers), which the paged KV "
            "cache cannot hold"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        return "its layers share K/V through transformers' cache object (num_kv_shared_layers)"
    if model_type in ATTENTION_EXTRAS_MODEL_TYPES:
        return "its attention takes sinks, which Carousel's attention backends do not compute"
    if not getattr(model_class, "_supports_attention_backend", False):
        return "the class does not support transformers' attention interface"
    if not model_class._can_set_attn_implementation():
        return "its attention modules do not dispatch through transformers' AttentionInterface"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional, not causal"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return f"its layer types {', '.join(other)} are not full or sliding attention"
    return why_batch_coupled(config)


def why_batch_coupled(config: PretrainedConfig) -> str | None:
    """Why `config`'s RoPE cannot run over a packed batch (its frequencies depend on the
    batch's largest position), or None."""
    coupled = sorted(set(rope_types(config)) & BATCH_COUPLED_ROPE)
    if not coupled:
        return None
    return (
        f"its {'/'.join(coupled)} RoPE picks its frequencies from the largest position in the "
        "whole packed batch, so one long request would change every other request's rotary"
    )


def rope_types(config: PretrainedConfig) -> Iterator[str]:
    """Every `rope_type` the config names (per layer type where it has several)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if not isinstance(params, Mapping):
            continue
        nested = [p for p in params.values() if isinstance(p, Mapping)]
        for entry in nested or [params]:
            kind = entry.get("rope_type", entry.get("type"))
            if kind is not None:
                yield str(kind)
