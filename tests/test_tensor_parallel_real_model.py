"""The real default model (SmolLM2-135M: 9 heads, 3 KV heads, hidden 576, intermediate 1536,
vocabulary 49152) over three ranks: every split dimension divides by 3 (one KV head per rank,
nothing replicated or padded; the hidden size is never split), and greedy outputs equal HF
`generate` and the one-process backend, token for token, under orca and static.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.runner.backend import TorchBackend
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Hi"]
MAX_TOKENS = [12, 20, 8]
DELAYS_S = [0.0, 0.05, 0.2]


@pytest.fixture(scope="module")
def tp3() -> Iterator[TensorParallelBackend]:
    backend = TensorParallelBackend.load(
        "default",
        tensor_parallel_size=3,
        device="cpu",
        dtype="float32",
        kv_cache_gb=0.1,
        max_model_len=512,
    )
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def one_process() -> Iterator[TorchBackend]:
    backend = TorchBackend.load(
        "default", device="cpu", dtype="float32", kv_cache_gb=0.1, max_model_len=512,
        quantization="none",
    )  # fmt: skip
    yield backend
    backend.close()


def chat_prompts(tokenizer: object) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


def generate(backend: TorchBackend, scheduler: str, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512)
    with LLM(backend, scheduler, config, {"batch_wait_ms": 20}) as llm:
        gens = llm.generate(prompts, params, delays_s=DELAYS_S)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return [g.choices[0].token_ids for g in gens]


def test_tp3_shards_the_default_model_one_kv_head_per_rank(tp3: TensorParallelBackend) -> None:
    ranks = tp3.describe()
    assert [(r["num_heads"], r["num_kv_heads"], r["first_kv_head"]) for r in ranks] == [
        (3, 1, 0),
        (3, 1, 1),
        (3, 1, 2),
    ]
    assert [r["vocab_rows"] for r in ranks] == [16384] * 3
    assert len({r["num_blocks"] for r in ranks}) == 1


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_tp3_greedy_equals_hf_generate_and_one_process(
    tp3: TensorParallelBackend, one_process: TorchBackend, scheduler: str
) -> None:
    prompts = chat_prompts(tp3.tokenizer)
    expected = []
    for prompt, m in zip(prompts, MAX_TOKENS, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = one_process.hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    assert generate(tp3, scheduler, prompts) == expected
    assert generate(one_process, scheduler, prompts) == expected
    assert tp3.tokenizer.decode(expected[0]).startswith("The capital of France is Paris.")


def test_tp2_is_refused_for_the_default_model_naming_the_valid_sizes() -> None:
    with pytest.raises(ValueError, match=r"9 attention heads.*valid sizes: 1, 3$"):
        TensorParallelBackend.load("default", tensor_parallel_size=2, device="cpu")
