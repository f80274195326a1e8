"""The torch backend: selective batching over paged KV matches HF's own forward, per sequence."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PretrainedConfig,
    PreTrainedModel,
)

from backends.torch import loader
from backends.torch.runner.backend import TorchBackend
from backends.torch.stacks import compiled_layer as dense
from backends.torch.stacks import inductor
from backends.torch.testing.tiny_models import BLOCK_SIZE, VOCAB, tiny_model, tiny_tokenizer
from schedulers import defaults
from schedulers.batch import Batch
from schedulers.block_manager import blocks_for
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.attention_fixture import EnginePath, engine_path_fixture  # noqa: F401


def make_backend(model: PreTrainedModel, path: EnginePath | None = None) -> TorchBackend:
    return TorchBackend(
        model, tiny_tokenizer(), device="cpu", kv_cache_gb=0.01, block_size=BLOCK_SIZE,
        **(path.kwargs() if path else {}),
    )  # fmt: skip


def make_seq(seq_id: int, num_prompt: int, rng: random.Random, free: list[int]) -> Sequence:
    """A greedy sequence whose block table (scattered blocks) covers 40 tokens."""
    prompt = [rng.randrange(VOCAB) for _ in range(num_prompt)]
    seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    seq.block_table = [free.pop() for _ in range(blocks_for(40, BLOCK_SIZE))]
    return seq


def reference_logits(model: PreTrainedModel, seq: Sequence, stop: int) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([seq.token_ids(0, stop)])
        return model(ids).logits[0, -1].float()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_selective_batching_matches_hf_forward_per_sequence(
    arch: str, engine_path: EnginePath
) -> None:
    model = tiny_model(arch)
    backend = make_backend(model, engine_path)
    rng = random.Random(1)
    free = list(range(backend.kv_cache_spec.num_blocks))
    rng.shuffle(free)
    a, b, c, d, e = (make_seq(i, n, rng, free) for i, n in enumerate([9, 13, 1, 5, 11]))
    # each step: (seq, tokens scheduled); B's 13-token prompt is prefilled in two chunks
    steps = [
        [(a, 9), (b, 6), (c, 1), (d, 5)],
        [(a, 1), (b, 7), (c, 1), (d, 1), (e, 11)],
        [(a, 1), (b, 1), (c, 1), (d, 1), (e, 1)],
        [(e, 1), (a, 1), (c, 1)],
    ]
    for iteration, step in enumerate(steps):
        batch = Batch(iteration)
        for seq, n in step:
            batch.add(seq, n)
        got = backend.logits(batch)
        for row, (seq, n) in enumerate(step):
            want = reference_logits(model, seq, seq.num_computed_tokens + n)
            torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
        for seq, n in step:  # what the scheduler's update would do, with arbitrary tokens
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(rng.randrange(VOCAB))


def test_execute_samples_greedily_only_for_sequences_that_complete() -> None:
    model = tiny_model("llama")
    backend = make_backend(model)
    rng = random.Random(2)
    free = list(range(backend.kv_cache_spec.num_blocks))
    full, chunked = make_seq(7, 6, rng, free), make_seq(8, 10, rng, free)
    batch = Batch(0)
    batch.add(full, 6)
    batch.add(chunked, 4)
    output = backend.execute(batch)
    assert list(output.sampled) == [7]
    want = reference_logits(model, full, 6)
    assert output.sampled[7].token_id == int(want.argmax())
    backend.release(7)


@pytest.mark.skipif(not inductor.compiler_available(), reason="no C++ compiler for Inductor")
def test_a_failing_compiler_leaves_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("the compiler broke")

    monkeypatch.setattr(dense, "compiled_decoder_layer", broken)
    model = tiny_model("llama")
    backend = make_backend(model, EnginePath("sdpa", compile=True))
    assert not backend.model.compiled
    rng = random.Random(4)
    seq = make_seq(3, 9, rng, list(range(backend.kv_cache_spec.num_blocks)))
    batch = Batch(0)
    batch.add(seq, 9)
    assert backend.execute(batch).sampled[3].token_id == int(
        reference_logits(model, seq, 9).argmax()
    )


def test_backend_reports_eos_context_and_kv_capacity() -> None:
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = [3, 5]
    backend = TorchBackend(model, tiny_tokenizer(), kv_cache_gb=0.01, max_model_len=64)
    assert backend.eos_token_ids == frozenset({3, 5, 256})
    assert backend.max_model_len == 64
    # 2 layers * K,V * 16 slots * 2 kv heads * 16 dims * 4 bytes = 8 KiB a block, capped at
    # max_num_seqs (the engine's default) sequences of 64 tokens (4 blocks each)
    cap = defaults.MAX_NUM_SEQS * 4
    assert backend.kv_cache_spec.num_blocks == min(int(0.01 * 1024**3) // 8192, cap)
    assert backend.kv_cache_spec.block_size == 16
    assert backend.tokenizer.decode(backend.tokenizer.encode("hi there")) == "hi there"


def test_the_native_path_refuses_other_architectures_with_the_supported_list(
    tmp_path: Path,
) -> None:
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        TorchBackend(GPT2LMHeadModel(config), tiny_tokenizer(), model_impl="carousel")
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        loader.load_model(str(tmp_path), model_impl="carousel")


def test_local_hf_dir_loads(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer = loader.load_model(str(tmp_path))
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert tokenizer.decode(tokenizer.encode("ok")) == "ok"


def fake_convert(gguf_path: Path, out_dir: Path) -> None:
    """Stands in for the (slow) de-quantizing conversion: writes a plain HF directory."""
    PretrainedConfig(architectures=["LlamaForCausalLM"]).to_json_file(out_dir / "config.json")
    save_file({"w": torch.zeros(1)}, str(out_dir / "model.safetensors"))


def test_gguf_path_is_converted_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAROUSEL_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", lambda p, o: (calls.append(p), fake_convert(p, o)))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    first = Path(loader.resolve_model(str(gguf)))
    second = Path(loader.resolve_model(str(gguf)))
    assert first == second and loader.is_hf_dir(first)
    assert first.parent == tmp_path / "cache" / "models" / "gguf"
    assert calls == [gguf]
    assert [p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")] == [first.name]
    with pytest.raises(FileNotFoundError):
        loader.resolve_model(str(tmp_path / "missing.gguf"))


def test_concurrent_conversions_convert_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def slow_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        time.sleep(0.2)
        fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(loader, "convert_gguf", slow_convert)
    target = tmp_path / "models" / "m"
    with ThreadPoolExecutor(2) as pool:
        done = list(
            pool.map(lambda _: loader.ensure_converted(tmp_path / "m.gguf", target), [0, 1])
        )
    assert done == [target, target] and len(calls) == 1 and loader.is_hf_dir(target)


@pytest.mark.real_model
def test_default_model_resolves_to_a_plain_hf_dir() -> None:
    path = Path(loader.resolve_model("default"))
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert path == loader.cache_dir() / "models" / loader.DEFAULT_MODEL_DIRNAME


@pytest.mark.real_model
def test_default_model_answers_the_capital_of_france() -> None:
    backend = TorchBackend.load("default", kv_cache_gb=0.1, max_model_len=256)
    tokenizer = backend.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    seq = Sequence(0, "france", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    seq.block_table = list(range(blocks_for(len(prompt) + 12, 16)))
    for iteration in range(12):
        batch = Batch(iteration)
        batch.add(seq, seq.num_tokens - seq.num_computed_tokens)
        token = backend.execute(batch).sampled[0].token_id
        seq.num_computed_tokens = seq.num_tokens
        if token in backend.eos_token_ids:
            break
        seq.output_token_ids.append(token)
    answer = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    assert answer == "The capital of France is Paris."
