"""The oracle on the generic path: architectures Carousel has no family file for, run by their
own transformers code over the paged KV cache, equal HF `generate` on each prompt alone.

Each tiny architecture (backends/torch/testing/tiny_generic.py, and the tiny Llama and Qwen2
forced onto the generic path) runs two phases in one engine: test_oracle.py's six prompts,
then a second turn of each (its prompt and answer, cut to 64 tokens, and three new tokens),
the turn of the request that finished last submitted first, so the prefix cache surely serves
its start (no other allocation came between). Under orca the KV cache holds one 80-token
context and the token budget is 16 with chunked prefill, so prompts are chunked and sequences
preempted; under static the batches form and run to completion. Every step's block
accounting is checked, and every block is free at the end.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from backends.torch.attention import available_backends
from backends.torch.generic.model import TransformersCausalLM
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_generic import (
    GENERIC_ARCHITECTURES,
    smollm2_shaped_llama,
    tiny_generic_model,
)
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM, Generation
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.test_grammar_scheduling import Collected, soon_all_blocks_free
from tests.test_oracle import DELAYS_S, MAX_TOKENS, hf_greedy, prompts
from tests.test_prefix_cache_oracle import check_accounting_after_every_step

#: the tiny Llama and Qwen2 (per-layer windows) through the generic path, beside the
#: architectures only it runs
ARCHS = [*GENERIC_ARCHITECTURES, "llama", "qwen2"]
#: a second turn's start kept from the first (with the question and answer, within 80 tokens)
KEPT = 64
NEW_QUESTION = [7, 11, 13]
SECOND_MAX_TOKENS = 6


def generic_model(arch: str) -> PreTrainedModel:
    model = tiny_generic_model(arch) if arch in GENERIC_ARCHITECTURES else tiny_model(arch)
    model.generation_config.eos_token_id = None
    return model


def second_turns(answers: list[list[int]]) -> list[list[int]]:
    """Phase 2's prompts: each phase-1 prompt with its answer (their first `KEPT` tokens), and a
    new question."""
    return [[*p, *a][:KEPT] + NEW_QUESTION for p, a in zip(prompts(), answers, strict=True)]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return generic_model(request.param)


def hf_two_phases(model: PreTrainedModel) -> tuple[list[list[int]], list[list[int]]]:
    """HF `generate`'s greedy answers to the prompts, then to each conversation's second turn."""
    phase1 = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    phase2 = [hf_greedy(model, p, SECOND_MAX_TOKENS) for p in second_turns(phase1)]
    return phase1, phase2


@pytest.fixture(scope="module")
def expected(arch_model: PreTrainedModel) -> tuple[list[list[int]], list[list[int]]]:
    return hf_two_phases(arch_model)


def generic_backend(model: PreTrainedModel, max_num_seqs: int = 64, **fields: Any) -> TorchBackend:
    """A backend on the generic path (`auto` takes it for every class but the Llama family's)."""
    return TorchBackend(
        model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=80,
        max_num_seqs=max_num_seqs, model_impl="transformers", **fields,
    )  # fmt: skip


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def two_phases(llm: LLM, delays_s: list[float]) -> tuple[list[Generation], list[Generation]]:
    """Both phases; phase 2 in phase 1's prompt order, its first-submitted request first."""
    finished: list[int] = []
    firsts = [tuple(p) for p in prompts()]

    def record(seq: Sequence) -> None:  # NOTE: on the engine thread: must not raise
        prompt = tuple(seq.prompt_token_ids)
        if prompt in firsts:
            finished.append(firsts.index(prompt))

    llm.engine.finish_listeners.append(record)
    first = llm.generate(prompts(), greedy(MAX_TOKENS), delays_s=delays_s)
    turns = second_turns([g.choices[0].token_ids for g in first])
    order = finished[::-1]  # the last to finish first: its blocks are the surely cached ones
    gens = llm.generate([turns[i] for i in order], greedy([SECOND_MAX_TOKENS] * len(order)))
    by_prompt = dict(zip(order, gens, strict=True))
    return first, [by_prompt[finished[-1]], *(by_prompt[i] for i in range(len(turns)))]


def assert_equal_with_a_hit(
    first: list[Generation],
    second: list[Generation],
    expected: tuple[list[list[int]], list[list[int]]],
) -> None:
    """Both phases equal HF's; the first second turn submitted was served partly from cache."""
    hit, *in_order = second
    assert (token_ids(first), token_ids(in_order)) == expected
    assert hit.choices[0].num_cached_tokens >= BLOCK_SIZE


def token_ids(gens: list[Generation]) -> list[list[int]]:
    return [g.choices[0].token_ids for g in gens]


def assert_orca_with_chunks_preemption_and_a_hit_exact(
    backend: Backend, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    """`backend` (KV for one 80-token context) under orca with 16-token chunks: two phases of
    greedy answers equal `expected` with a prefix hit, a preemption, chunked long prompts,
    the block accounting right after every step and every block free at the end."""
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=16, enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )  # fmt: skip
    llm = LLM(backend, "orca", config)
    errors = check_accounting_after_every_step(llm)
    try:
        # NOTE: submitted at once, so they surely compete for the KV (see test_oracle.py)
        first, second = two_phases(llm, [0.0] * len(DELAYS_S))
    finally:
        llm.close()
    assert_equal_with_a_hit(first, second, expected)
    assert not errors, errors[0]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    prefills = [r.num_prefill_tokens for r in engine.trace if r.num_prefill_tokens]
    assert max(prefills) <= 16 < max(len(p) for p in prompts())  # the long prompts came in chunks
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_orca_with_chunks_preemption_and_a_prefix_hit_equals_hf_generate(
    arch_model: PreTrainedModel, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    backend = generic_backend(arch_model, max_num_seqs=1)  # KV for one 80-token context
    assert isinstance(backend.model, TransformersCausalLM)
    assert_orca_with_chunks_preemption_and_a_hit_exact(backend, expected)


def test_static_batches_with_a_prefix_hit_equal_hf_generate(
    arch_model: PreTrainedModel, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=True)
    llm = LLM(generic_backend(arch_model), "static", config, {"batch_wait_ms": 20})
    errors = check_accounting_after_every_step(llm)
    try:
        first, second = two_phases(llm, DELAYS_S)
    finally:
        llm.close()
    assert_equal_with_a_hit(first, second, expected)
    assert not errors, errors[0]
    engine = llm.engine
    assert not [r for r in engine.trace if r.num_prefill_tokens and r.num_decode_tokens]
    assert max(r.batch_size for r in engine.trace) > 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("attention_backend", available_backends(torch.device("cpu")))
def test_every_attention_backend_serves_the_generic_path(attention_backend: str) -> None:
    """Gemma 3 (a window, its own query scale) through each attention backend of the CPU."""
    model = generic_model("gemma3")
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    backend = generic_backend(model, attention_backend=attention_backend)
    assert backend.model.attention.name == attention_backend
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    with LLM(backend, "orca", config) as llm:
        gens = llm.generate(prompts(), greedy(MAX_TOKENS), delays_s=DELAYS_S)
    assert token_ids(gens) == expected


def test_the_hf_model_is_given_back_as_it_was_after_steps() -> None:
    """Attention implementation and `nn.Linear` forwards are swapped for a step only: HF
    `generate` on the same model afterwards is unchanged (the packed linears did run)."""
    model = generic_model("phi3")
    before = hf_greedy(model, prompts()[1], 8)
    implementation = model.config._attn_implementation
    backend = generic_backend(model)
    assert backend.model.linears is not None and backend.model.linears.swaps
    with LLM(backend, "orca", SchedulerConfig(max_num_seqs=4)) as llm:
        assert token_ids(llm.generate([prompts()[1]], greedy([8]))) == [before]
    assert model.config._attn_implementation == implementation
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    assert hf_greedy(model, prompts()[1], 8) == before


def test_an_aborted_request_frees_its_blocks_and_spares_the_others() -> None:
    model = generic_model("gemma2")  # soft-capped layers: softcap.py's attention
    prompt = prompts()[5]
    expected = hf_greedy(model, prompt, 12)
    with LLM(generic_backend(model), "orca", SchedulerConfig(max_num_seqs=4)) as llm:
        aborted, kept = Collected(), Collected()
        llm.engine.submit("aborted", prompts()[0], greedy([70])[0], aborted)
        llm.engine.submit("kept", prompt, greedy([12])[0], kept)
        deadline = time.monotonic() + 30
        while len(aborted.token_ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        llm.engine.abort("aborted")
        assert aborted.done.wait(30) and kept.done.wait(30)
        assert {o.finish_reason for o in aborted.outputs if o.finished} == {"abort"}
        assert kept.token_ids == expected
        assert soon_all_blocks_free(llm)


def test_generic_path_gives_the_native_paths_tokens_on_a_smollm2_shaped_llama() -> None:
    model = smollm2_shaped_llama()
    model.generation_config.eos_token_id = None
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    outputs = {}
    for impl in ("carousel", "transformers"):
        backend = TorchBackend(
            model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=128,
            max_num_seqs=8, model_impl=impl,
        )  # fmt: skip
        with LLM(backend, "orca", config) as llm:
            outputs[impl] = token_ids(llm.generate(prompts(), greedy(MAX_TOKENS), DELAYS_S))
    assert outputs["transformers"] == outputs["carousel"]
    assert outputs["carousel"][0] == hf_greedy(model, prompts()[0], MAX_TOKENS[0])


@pytest.mark.real_model
def test_default_model_on_the_generic_path_equals_hf_generate() -> None:
    backend = TorchBackend.load(
        "default", device="cpu", dtype="float32", kv_cache_gb=0.25, max_model_len=512,
        model_impl="transformers",
    )  # fmt: skip
    assert isinstance(backend.model, TransformersCausalLM)
    tokenizer = backend.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Hi"]
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    prompts_ = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in rendered]
    max_tokens = [12, 24, 8]
    expected = [
        hf_greedy(backend.hf_model, p, m) for p, m in zip(prompts_, max_tokens, strict=True)
    ]
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=512)
    with LLM(backend, "orca", config) as llm:
        gens = llm.generate(prompts_, greedy(max_tokens), delays_s=[0.0, 0.05, 0.1])
    assert token_ids(gens) == expected
    assert gens[0].choices[0].text.startswith("The capital of France is Paris.")
