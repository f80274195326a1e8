"""Tiny randomly initialised models of each supported architecture, and a byte tokenizer."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]

VOCAB = 320
BLOCK_SIZE = 4
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + `<eos>`) with a working decode."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    model = models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def tiny_model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if arch == "llama":
        # llama3 rope scaling: the backend must use HF's rotary module, not plain RoPE
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}  # fmt: skip
        return LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope))
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))
    if arch == "qwen2":
        config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1)
        return Qwen2ForCausalLM(config)  # layer 0 full attention, layer 1 sliding
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16))
