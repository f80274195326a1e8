"""Tiny randomly initialised models of architectures only the generic path runs (generic/).

Each one carries what makes its architecture differ from Llama, so an oracle test against
transformers' `generate` fails where the generic path gets that part wrong: Phi-3's fused
`qkv_proj`/`gate_up_proj` and partial rotary, Gemma 2's attention and final soft-capping,
Gemma 3's sliding `layer_types` with a rotary base per layer type, Gemma's `(1 + w)` norms
(their weights randomised: transformers initialises them to zero) and embedding scale, and
three mixture-of-experts routings (Qwen3-MoE with a dense layer, OLMoE, Mixtral with a window).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from backends.torch.testing.tiny_models import TINY, VOCAB

GENERIC_ARCHITECTURES = ["phi3", "gemma2", "gemma3", "qwen3_moe", "olmoe", "mixtral"]
#: token ids inside the tiny vocabulary (the configs' defaults point past it)
_IDS: dict[str, Any] = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: Gemma's geometry: head size and query scale of their own, a short window
_GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=64, sliding_window=5)
#: SmolLM2-135M's layer (hidden 576, 9 heads over 3 K/V heads of 64, intermediate 1536,
#: tied embeddings, rotary base 1e5) in 2 layers over the tiny vocabulary
SMOLLM2_SHAPED: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=128,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    initializer_range=0.1,
)  # fmt: skip


def tiny_generic_model(arch: str) -> PreTrainedModel:
    """The tiny random model of `arch` (one of `GENERIC_ARCHITECTURES`), in fp32."""
    torch.manual_seed(0)
    model = _build(arch)
    if arch.startswith("gemma"):
        _randomise_norms(model)
    return model.eval()


def smollm2_shaped_llama() -> LlamaForCausalLM:
    """A 2-layer random Llama of SmolLM2-135M's layer shape (native and generic alike)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPED, **_IDS)).eval()


def _build(arch: str) -> PreTrainedModel:
    if arch == "phi3":
        rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        return Phi3ForCausalLM(Phi3Config(**TINY, **_IDS, rope_parameters=rope, sliding_window=7))
    if arch == "gemma2":
        return Gemma2ForCausalLM(
            Gemma2Config(
                **TINY, **_IDS, **_GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=5.0
            )
        )
    if arch == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        }
        layer_types = ["sliding_attention", "full_attention"]
        config = Gemma3TextConfig(**TINY, **_IDS, **_GEMMA, layer_types=layer_types,
                                  rope_parameters=rope)  # fmt: skip
        return Gemma3ForCausalLM(config)
    if arch == "qwen3_moe":
        moe = Qwen3MoeConfig(**TINY, **_IDS, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, mlp_only_layers=[0])  # fmt: skip
        return Qwen3MoeForCausalLM(moe)
    if arch == "olmoe":
        return OlmoeForCausalLM(OlmoeConfig(**TINY, **_IDS, num_experts=8, num_experts_per_tok=2))
    if arch == "mixtral":
        mixtral = MixtralConfig(**TINY, **_IDS, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=6)  # fmt: skip
        return MixtralForCausalLM(mixtral)
    raise ValueError(f"no tiny generic model {arch!r}; choose one of {GENERIC_ARCHITECTURES}")


def _randomise_norms(model: PreTrainedModel) -> None:
    """Every norm's weight drawn at random: with the zeros transformers initialises Gemma's
    `(1 + w)` norms to, a `w` for `1 + w` mix-up would pass unseen."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
