"""What the generic path refuses (one line naming the class and the reason, before any weight
is read), and which path `--model-impl` chooses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import (
    BartConfig,
    BloomConfig,
    Gemma3nTextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    JambaConfig,
    LlamaConfig,
    MambaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3NextConfig,
    T5Config,
)

from backends.torch.config import TorchBackendConfig
from backends.torch.generic.model import TransformersCausalLM
from backends.torch.generic.probe import probe_layers
from backends.torch.generic.support import check_model, resolve_model_impl
from backends.torch.loader import load_model
from backends.torch.model import PagedCausalLM
from backends.torch.models import architecture_of
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_generic import tiny_generic_model
from backends.torch.testing.tiny_models import BLOCK_SIZE, TINY, tiny_model, tiny_tokenizer
from gateway.cli import main
from gateway.settings.load import Settings

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
LONGROPE = {
    "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
    "rope_theta": 1e4, "original_max_position_embeddings": 64,
}  # fmt: skip


def refusal(config: PretrainedConfig, model_impl: str = "auto") -> str:
    """The one-line refusal of `config`'s class under `model_impl`."""
    with pytest.raises(ValueError) as refused:
        check_model(config, architecture_of(config), model_impl)
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("config", "name"),
    [
        (MambaConfig(), "MambaForCausalLM"),
        (JambaConfig(), "JambaForCausalLM"),
        (Qwen3NextConfig(), "Qwen3NextForCausalLM"),
        (Gemma3nTextConfig(), "Gemma3nForCausalLM"),
    ],
    ids=lambda v: getattr(v, "model_type", v),
)
def test_a_model_keeping_state_in_hfs_cache_is_refused_by_name(
    config: PretrainedConfig, name: str
) -> None:
    message = refusal(config)
    assert message.startswith(f"{name} cannot run on the generic (transformers) path: ")
    assert "keeps per-sequence state in transformers' cache object" in message


@pytest.mark.parametrize(
    "config",
    [T5Config(architectures=["T5ForConditionalGeneration"]), BartConfig()],
    ids=["t5", "bart"],
)
def test_an_encoder_decoder_is_refused(config: PretrainedConfig) -> None:
    assert "it is an encoder-decoder model" in refusal(config)


def test_a_class_without_attention_interface_support_is_refused() -> None:
    message = refusal(BloomConfig())
    assert message.startswith("BloomForCausalLM cannot run")
    assert "does not support transformers' attention interface" in message


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (LlamaConfig(**TINY, rope_parameters=DYNAMIC), "dynamic"),
        (Phi3Config(**TINY, rope_parameters=LONGROPE), "longrope"),
    ],
    ids=["dynamic", "longrope"],
)
def test_rope_chosen_by_the_batchs_largest_position_is_refused(
    config: PretrainedConfig, kind: str
) -> None:
    message = refusal(config, "transformers")
    assert f"its {kind} RoPE picks its frequencies from the largest position" in message


def test_the_native_path_refuses_batch_coupled_rope_too() -> None:
    config = LlamaConfig(**TINY, rope_parameters=DYNAMIC)
    assert "LlamaForCausalLM cannot run on the native path" in refusal(config, "carousel")


def test_attention_with_sinks_is_refused_by_name_and_by_the_probe() -> None:
    config = GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    assert "its attention takes sinks" in refusal(config)
    with pytest.raises(ValueError, match="GptOssForCausalLM .* layer 0's attention passes s_aux"):
        probe_layers(GptOssForCausalLM(config))


def test_a_refused_model_is_refused_before_its_weights_are_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MambaConfig().to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="^MambaForCausalLM cannot run on the generic"):
        load_model(str(tmp_path))


# -- `--model-impl` ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "architecture", "chosen"),
    [
        ("auto", "LlamaForCausalLM", "carousel"),
        ("auto", "Qwen3ForCausalLM", "carousel"),
        ("auto", "Gemma3ForCausalLM", "transformers"),
        ("auto", "MixtralForCausalLM", "transformers"),
        ("transformers", "LlamaForCausalLM", "transformers"),
        ("carousel", "Gemma3ForCausalLM", "carousel"),
    ],
)
def test_auto_takes_the_native_path_for_its_families_only(
    requested: str, architecture: str, chosen: str
) -> None:
    assert resolve_model_impl(requested, architecture) == chosen


def backend(arch: str, generic: bool = False, **fields: Any) -> TorchBackend:
    model = tiny_generic_model(arch) if generic else tiny_model(arch)
    return TorchBackend(model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE,
                        max_model_len=64, max_num_seqs=2, **fields)  # fmt: skip


def test_the_backend_builds_the_model_of_the_chosen_path() -> None:
    assert isinstance(backend("llama").model, PagedCausalLM)
    assert isinstance(backend("llama", model_impl="transformers").model, TransformersCausalLM)
    assert isinstance(backend("gemma3", generic=True).model, TransformersCausalLM)
    with pytest.raises(ValueError, match="unsupported model architecture 'Gemma3ForCausalLM'"):
        backend("gemma3", generic=True, model_impl="carousel")


@pytest.mark.parametrize(
    "fields",
    [{"compile": True}, {"native_layers": True}, {"quantization": "int8"},
     {"batch_invariant": True}],
    ids=lambda f: next(iter(f)),
)  # fmt: skip
def test_the_generic_path_refuses_what_it_cannot_honour(fields: dict[str, Any]) -> None:
    name = next(iter(fields))
    assert TorchBackendConfig.unhonoured({"model_impl": "transformers", **fields}) == [name]
    with pytest.raises(ValueError, match=rf"generic \(transformers\) .* cannot honour {name}\b"):
        TorchBackendConfig(model_impl="transformers", **fields)
    with pytest.raises(ValueError, match=rf"cannot honour {name}\b"):  # `auto` chose it
        backend("gemma3", generic=True, **fields)


def test_the_generic_path_takes_tensor_parallelism() -> None:
    """Whether a model's own plan can split it is asked at load (tests/test_generic_tp.py)."""
    assert (
        TorchBackendConfig.unhonoured({"model_impl": "transformers", "tensor_parallel_size": 2})
        == []
    )
    TorchBackendConfig(model_impl="transformers", tensor_parallel_size=2)


def test_the_gateway_refuses_them_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match="model_impl transformers cannot honour compile"):
        Settings(model_impl="transformers", compile=True)  # type: ignore[arg-type]
    assert main(["serve", "--model-impl", "transformers", "--compile", "--port", "0"]) == 2
    assert "cannot honour compile" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        Settings(model_impl="vllm")  # type: ignore[arg-type]
