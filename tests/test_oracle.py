"""The oracle: batched greedy outputs equal Hugging Face `generate` on each prompt alone.

Prompts of very different lengths are submitted at staggered times, so under `orca` prefills
and decodes share iterations, and under `static` later arrivals wait for the next batch.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
from transformers import PreTrainedModel

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import (
    ARCHITECTURES,
    BLOCK_SIZE,
    VOCAB,
    tiny_model,
    tiny_tokenizer,
)
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from schedulers.structured_output import CompiledGrammar, GrammarSpec
from tests.attention_fixture import EnginePath, engine_path_fixture  # noqa: F401

PROMPT_LENGTHS = [3, 41, 9, 70, 1, 24]
# NOTE: the first request decodes long enough (60 steps) that the later ones arrive while it
# runs, however fast a tiny model's decode step is
MAX_TOKENS = [60, 5, 20, 8, 16, 10]
DELAYS_S = [0.0, 0.0, 0.01, 0.02, 0.03, 0.05]


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What `generate` gives this prompt alone, EOS ignored."""
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def run_engine(
    backend: TorchBackend,
    scheduler: str,
    config: SchedulerConfig,
    policy_options: dict[str, float] | None = None,
    delays_s: list[float] = DELAYS_S,
) -> tuple[list[list[int]], LLM]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    llm = LLM(backend, scheduler, config, policy_options)
    try:
        gens = llm.generate(prompts(), params, delays_s=delays_s)
    finally:
        llm.close()
    return [g.choices[0].token_ids for g in gens], llm


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_model(request: pytest.FixtureRequest) -> tuple[str, PreTrainedModel]:
    model = tiny_model(request.param)
    model.generation_config.eos_token_id = None
    return request.param, model


@pytest.fixture(scope="module")
def expected(arch_model: tuple[str, PreTrainedModel]) -> list[list[int]]:
    _, model = arch_model
    return [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]


def make_backend(
    model: PreTrainedModel,
    path: EnginePath | None = None,
    max_num_seqs: int = 64,
    max_model_len: int = 128,
) -> TorchBackend:
    return TorchBackend(
        model,
        tiny_tokenizer(),
        device="cpu",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        **(path.kwargs() if path else {}),
    )


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_batched_greedy_equals_hf_generate_alone(
    arch_model: tuple[str, PreTrainedModel],
    expected: list[list[int]],
    scheduler: str,
    engine_path: EnginePath,
) -> None:
    _, model = arch_model
    backend = make_backend(model, engine_path)
    # NOTE: static waits 20 ms to fill a batch, so the two requests submitted together at
    # t = 0 always share one, however late the engine thread wakes on a loaded machine.
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    outputs, llm = run_engine(backend, scheduler, config, {"batch_wait_ms": 20})
    assert outputs == expected
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    mixed = [r for r in engine.trace if r.num_prefill_tokens and r.num_decode_tokens]
    if scheduler == "orca":
        assert mixed, "orca never mixed a prefill with decodes"
    else:
        assert not mixed, "static admitted a request into a running batch"
        assert max(r.batch_size for r in engine.trace) > 1


def test_chunked_prefill_and_preemption_keep_greedy_outputs(
    arch_model: tuple[str, PreTrainedModel], expected: list[list[int]], engine_path: EnginePath
) -> None:
    _, model = arch_model
    # KV for one 80-token context (20 blocks), far less than the prompts need together
    backend = make_backend(model, engine_path, max_num_seqs=1, max_model_len=80)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, enable_chunked_prefill=True)
    # NOTE: all submitted at once, so they surely compete for the KV (staggered arrivals can
    # finish early ones first on a fast, idle machine, and then nothing is preempted)
    outputs, llm = run_engine(backend, "orca", config, delays_s=[0.0] * len(DELAYS_S))
    assert outputs == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain briefly why each is prime.",
    "Hi",
]
DEFAULT_MAX_TOKENS = [12, 24, 32, 8]


def load_default_model(**engine: Any) -> TorchBackend:
    """The default model in fp32 on the engine path `engine` names."""
    return TorchBackend.load(
        "default", device="cpu", dtype="float32", kv_cache_gb=0.25, max_model_len=512,
        quantization="none", **engine,
    )  # fmt: skip


def chat_prompts(tokenizer: Any, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat, rendered and tokenized by the model's template."""
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    return [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in rendered]


@pytest.fixture(scope="module")
def default_model_expected() -> tuple[list[list[int]], list[list[int]]]:
    """The default model's prompts and what HF `generate` (HF's own modules) gives each alone:
    the same for every engine path, so computed once per module (9 s of each test, else)."""
    backend = load_default_model()
    prompts_ = chat_prompts(backend.tokenizer, DEFAULT_QUESTIONS)
    expected_ = [
        hf_greedy(backend.hf_model, p, m) for p, m in zip(prompts_, DEFAULT_MAX_TOKENS, strict=True)
    ]
    return prompts_, expected_


@pytest.mark.real_model
@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_default_model_batched_greedy_equals_hf_generate(
    scheduler: str,
    engine_path: EnginePath,
    default_model_expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    backend = load_default_model(**engine_path.kwargs())
    prompts_, expected_ = default_model_expected
    assert chat_prompts(backend.tokenizer, DEFAULT_QUESTIONS) == prompts_
    max_tokens = DEFAULT_MAX_TOKENS
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=512)
    with LLM(backend, scheduler, config) as llm:
        gens = llm.generate(prompts_, params, delays_s=[0.0, 0.05, 0.1, 0.3])
    assert [g.choices[0].token_ids for g in gens] == expected_
    assert gens[0].choices[0].text.startswith("The capital of France is Paris.")


#: what the constrained batch mates write: a small JSON object
MATE_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
}


def with_constrained_mates(
    llm: LLM, prompts_: list[list[int]], params: list[SamplingParams], delays_s: list[float]
) -> tuple[list[list[int]], list[str]]:
    """Run `prompts_` greedily with a JSON-constrained request at temperature 1 submitted
    beside each; the free outputs' token ids and the constrained outputs' texts."""
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    grammar = compiler.submit(GrammarSpec.json_schema(MATE_SCHEMA)).result(timeout=60)
    assert isinstance(grammar, CompiledGrammar), grammar
    mates = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=grammar)
        for i in range(len(prompts_))
    ]
    gens = llm.generate([*prompts_, *prompts_], [*params, *mates], delays_s=[*delays_s, *delays_s])
    free, constrained = gens[: len(prompts_)], gens[len(prompts_) :]
    return [g.choices[0].token_ids for g in free], [g.choices[0].text for g in constrained]


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_greedy_outputs_unchanged_beside_constrained_requests(
    arch_model: tuple[str, PreTrainedModel], expected: list[list[int]], scheduler: str
) -> None:
    _, model = arch_model
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    with LLM(make_backend(model), scheduler, config, {"batch_wait_ms": 20}) as llm:
        outputs, texts = with_constrained_mates(llm, prompts(), params, DELAYS_S)
        assert outputs == expected
        for text in texts:  # the mates were constrained (and shared batches with the others)
            jsonschema.validate(json.loads(text), MATE_SCHEMA)
        assert any(r.batch_size > 1 for r in llm.engine.trace)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.real_model
def test_default_model_greedy_unchanged_beside_constrained_requests() -> None:
    backend = load_default_model()
    questions = ["What is the capital of France?", "Name a prime number.", "Hi"]
    prompts_ = chat_prompts(backend.tokenizer, questions)
    max_tokens = [12, 10, 8]
    expected_ = [
        hf_greedy(backend.hf_model, p, m) for p, m in zip(prompts_, max_tokens, strict=True)
    ]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=512)
    with LLM(backend, "orca", config) as llm:
        outputs, texts = with_constrained_mates(llm, prompts_, params, [0.0, 0.05, 0.1])
    assert outputs == expected_
    for text in texts:
        jsonschema.validate(json.loads(text), MATE_SCHEMA)
