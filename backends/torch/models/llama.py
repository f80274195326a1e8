"""The Llama family: Llama, Mistral, Qwen2, Qwen3 (one decoder layer, four spellings).

Pre-norm decoder layers with an RMSNorm before attention and before the MLP, rotary on Q and
K, grouped-query attention, a SiLU-gated MLP; Qwen2 adds Q/K/V biases and per-layer sliding
windows, Qwen3 a per-head RMSNorm on Q and K before rotary, Mistral one window for every layer.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from backends.torch.attention.base import AttentionSpec
from backends.torch.layers.fused import fuse_rows
from backends.torch.models.base import (
    ArchitectureFamily,
    DecoderLayerWeights,
    LinearWeights,
    ModelWeights,
    NormWeights,
    TPRule,
)

#: the HF norm classes whose formula is Carousel's `rms_norm` kernel's (weight * x / rms(x))
_KERNEL_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
#: a layer's projections -> their module paths inside a HF decoder layer
_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _linear(module: Any) -> LinearWeights:
    return LinearWeights(module.weight, module.bias)


def _norm(module: Any) -> NormWeights:
    return NormWeights(
        module=module,
        weight=module.weight,
        eps=float(getattr(module, "variance_epsilon", 0.0)),
        kernel_formula=type(module).__name__ in _KERNEL_NORMS,
    )


def _sliding_window(attn: Any, config: object) -> int | None:
    """Per-layer window (Qwen2/3 set it on the module), else the config's (Mistral)."""
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    return None if window is None else int(window)


def _spec(attn: Any, config: object) -> AttentionSpec:
    """A layer's attention geometry, read off its own projections (a tensor-parallel rank
    holds only some heads)."""
    head_dim = int(attn.head_dim)
    return AttentionSpec(
        num_heads=attn.q_proj.weight.shape[0] // head_dim,
        num_kv_heads=attn.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim,
        scale=float(attn.scaling),
        sliding_window=_sliding_window(attn, config),
    )


class LlamaFamily(ArchitectureFamily):
    name: ClassVar[str] = "llama"
    architectures: ClassVar[dict[str, str]] = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }
    gguf_layer_names: ClassVar[dict[str, str]] = {
        "attn_q": _MODULES["q"],
        "attn_k": _MODULES["k"],
        "attn_v": _MODULES["v"],
        "attn_output": _MODULES["o_proj"],
        "ffn_gate": _MODULES["gate"],
        "ffn_up": _MODULES["up"],
        "ffn_down": _MODULES["down"],
    }
    gguf_top_names: ClassVar[dict[str, str]] = {
        "output": "lm_head",
        "token_embd": "model.embed_tokens",
    }
    # NOTE: convert_hf_to_gguf.py interleaves each head's rotary halves of Llama's Q and K
    gguf_rotary_permuted: ClassVar[dict[str, tuple[str, ...]]] = {"llama": ("attn_q", "attn_k")}
    tp_rules: ClassVar[tuple[TPRule, ...]] = (
        (re.compile(r"(embed_tokens|lm_head)\.weight$"), 0, "vocab"),
        (re.compile(r"q_proj\.(weight|bias)$"), 0, "q_heads"),
        (re.compile(r"[kv]_proj\.(weight|bias)$"), 0, "kv_heads"),
        (re.compile(r"o_proj\.weight$"), 1, "q_heads"),
        (re.compile(r"(gate|up)_proj\.(weight|bias)$"), 0, "intermediate"),
        (re.compile(r"down_proj\.weight$"), 1, "intermediate"),
    )
    tp_replicated: ClassVar[re.Pattern[str]] = re.compile(
        r"(norm\.weight|norm\.bias|o_proj\.bias|down_proj\.bias)$"
    )
    layer_prefix: ClassVar[str] = "model.layers.{}."

    def weights(self, hf_model: Any) -> ModelWeights:
        base, config = hf_model.model, hf_model.config
        layers = tuple(self._layer(i, layer, config) for i, layer in enumerate(base.layers))
        embed_weight = base.embed_tokens.weight
        tied = hf_model.lm_head.weight.data_ptr() == embed_weight.data_ptr()
        head_names = ("lm_head", "model.embed_tokens") if tied else ("lm_head",)
        return ModelWeights(
            family=self.name,
            embed=base.embed_tokens,
            rotary=base.rotary_emb,
            layers=layers,
            final_norm=_norm(base.norm),
            lm_head=hf_model.lm_head,
            tied=tied,
            lm_head_names=head_names,
            hidden_act=getattr(config, "hidden_act", None),
        )

    def _layer(self, index: int, layer: Any, config: object) -> DecoderLayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        head_norms = None
        if q_norm is not None and k_norm is not None:
            head_norms = (_norm(q_norm), _norm(k_norm))
        prefix = self.layer_prefix.format(index)
        names = {key: (prefix + module,) for key, module in _MODULES.items()}
        checkpoint_names = {
            "qkv": names["q"] + names["k"] + names["v"],
            **{key: names[key] for key in ("o_proj", "gate", "up", "down")},
        }
        return DecoderLayerWeights(
            index=index,
            owner=layer,
            spec=_spec(attn, config),
            qkv=fuse_rows(layer, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
            o_proj=_linear(attn.o_proj),
            gate=_linear(mlp.gate_proj),
            up=_linear(mlp.up_proj),
            down=_linear(mlp.down_proj),
            input_norm=_norm(layer.input_layernorm),
            post_norm=_norm(layer.post_attention_layernorm),
            head_norms=head_norms,
            act_fn=mlp.act_fn,
            act_is_silu=getattr(config, "hidden_act", None) == "silu",
            checkpoint_names=checkpoint_names,
        )
