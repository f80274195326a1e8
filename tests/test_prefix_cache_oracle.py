"""The oracle with prefix caching: requests served partly from cached KV still equal Hugging
Face `generate` on each prompt alone, token for token.

Phase 1 computes a few prompts; phase 2 sends requests that hit what phase 1 cached: the
same system prompt with other questions, a prefix that ends exactly on a block boundary, a
prompt cached whole, a block-aligned prompt cached whole (its last block is recomputed), a
second turn that resends the first turn's prompt and answer, and `n = 2` choices. Under orca,
static and lpm, with chunked prefill, and with preemption forced by a small KV cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import ARCHITECTURES, BLOCK_SIZE, VOCAB, tiny_model
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM, Generation
from schedulers.sampling_params import SamplingParams
from tests.test_oracle import hf_greedy, make_backend

rng = random.Random(7)


def tokens(n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


SYSTEM = tokens(22)  # five full blocks and two tokens
ALIGNED = tokens(16)  # exactly four blocks
FIRST_TURN = [*SYSTEM, *tokens(5)]
SECOND_QUESTION = tokens(6)
PHASE1 = [FIRST_TURN, ALIGNED]
PHASE1_MAX = [9, 6]
#: (name, prompt or a function of phase 1's first output, max_tokens, expected cached tokens)
PHASE2: list[tuple[str, list[int] | Callable[[list[int]], list[int]], int, int]] = [
    ("same system prompt", [*SYSTEM, *tokens(7)], 8, 20),
    ("prefix ends on a block boundary", [*SYSTEM[:20], *tokens(3)], 6, 20),
    ("whole prompt cached", list(FIRST_TURN), 7, 24),
    ("block-aligned prompt cached whole", list(ALIGNED), 5, 12),
    ("second turn", lambda answer: [*FIRST_TURN, *answer, *SECOND_QUESTION], 6, 32),
]


def phase2_prompts(answer: list[int]) -> list[list[int]]:
    return [p(answer) if callable(p) else p for _, p, _, _ in PHASE2]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    model = tiny_model(request.param)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def expected(model: PreTrainedModel) -> tuple[list[list[int]], list[list[int]]]:
    phase1 = [hf_greedy(model, p, m) for p, m in zip(PHASE1, PHASE1_MAX, strict=True)]
    prompts = phase2_prompts(phase1[0])
    phase2 = [hf_greedy(model, p, m) for p, (_, _, m, _) in zip(prompts, PHASE2, strict=True)]
    return phase1, phase2


Phases = tuple[list[Generation], list[Generation], LLM]


def run(backend: TorchBackend, scheduler: str, config: SchedulerConfig) -> Phases:
    """Both phases, the block accounting checked after every step and every finish."""
    llm = LLM(backend, scheduler, config, {"batch_wait_ms": 20})
    errors = check_accounting_after_every_step(llm)
    try:
        first = llm.generate(PHASE1, [greedy(m) for m in PHASE1_MAX])
        prompts = phase2_prompts(first[0].choices[0].token_ids)
        params = [greedy(m) for _, _, m, _ in PHASE2]
        second = llm.generate([*prompts, FIRST_TURN], [*params, greedy(9, n=2)])
    finally:
        llm.close()
    assert not errors, errors[0]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    return first, second, llm


def check_accounting_after_every_step(llm: LLM) -> list[AssertionError]:
    """Check the block accounting on the engine thread after every step and finish."""
    engine = llm.engine
    errors: list[AssertionError] = []

    def check(_: object) -> None:
        try:
            engine.block_manager.check_invariants(engine.scheduler.running)
        except AssertionError as exc:  # NOTE: raised on the engine thread; reported below
            errors.append(exc)

    engine.iteration_listeners.append(check)
    engine.finish_listeners.append(check)
    return errors


def outputs(gens: list[Generation]) -> list[list[int]]:
    return [c.token_ids for g in gens for c in g.choices]


def assert_matches(
    first: list[Generation],
    second: list[Generation],
    llm: LLM,
    expected: tuple[list[list[int]], list[list[int]]],
    caching: bool,
) -> None:
    phase1, phase2 = expected
    assert outputs(first) == phase1
    assert outputs(second) == [*phase2, phase1[0], phase1[0]]  # n = 2: both equal choice 0
    bm = llm.engine.block_manager
    if caching:
        assert bm.prefix_cache_hits > 0
        assert sum(r.num_cached_tokens for r in llm.engine.trace) == bm.prefix_cache_hits
    else:
        assert bm.prefix_cache_hits == 0 and not any(r.num_cached_tokens for r in llm.engine.trace)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("scheduler", ["orca", "static", "lpm"])
def test_requests_that_hit_the_cache_equal_hf_generate(
    model: PreTrainedModel, expected: tuple[list[list[int]], list[list[int]]], scheduler: str,
    caching: bool,
) -> None:  # fmt: skip
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=caching
    )
    first, second, llm = run(make_backend(model), scheduler, config)
    assert_matches(first, second, llm, expected, caching)
    if caching:
        hits = [g.choices[0].num_cached_tokens for g in second[: len(PHASE2)]]
        assert hits == [cached for _, _, _, cached in PHASE2]
        assert second[-1].choices[1].num_cached_tokens >= 24  # the later choice shares all
    else:
        assert all(c.num_cached_tokens == 0 for g in second for c in g.choices)


@pytest.mark.parametrize("scheduler", ["orca", "lpm"])
def test_chunked_prefill_after_a_hit_equals_hf_generate(
    model: PreTrainedModel, expected: tuple[list[list[int]], list[list[int]]], scheduler: str
) -> None:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=6, enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )  # fmt: skip
    first, second, llm = run(make_backend(model), scheduler, config)
    assert_matches(first, second, llm, expected, caching=True)
    chunked = [r for r in llm.engine.trace if r.num_cached_tokens and r.num_prefill_tokens]
    assert chunked, "no step computed a prefill after a hit"


@pytest.mark.parametrize("scheduler", ["orca", "static", "lpm"])
def test_a_small_kv_cache_with_preemption_equals_hf_generate(
    model: PreTrainedModel, expected: tuple[list[list[int]], list[list[int]]], scheduler: str
) -> None:
    # KV for one 56-token context (14 blocks): prompts and outputs evict each other's blocks
    backend = make_backend(model, max_num_seqs=1, max_model_len=56)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )  # fmt: skip
    first, second, llm = run(backend, scheduler, config)
    assert_matches(first, second, llm, expected, caching=True)
    if scheduler != "static":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_n_choices_prefill_the_prompt_once(model: PreTrainedModel, caching: bool) -> None:
    config = SchedulerConfig(max_num_seqs=8, enable_prefix_caching=caching)
    with LLM(make_backend(model), "orca", config) as llm:
        [gen] = llm.generate([FIRST_TURN], greedy(4, n=3))
    prefill = sum(r.num_prefill_tokens for r in llm.engine.trace)
    last_block = len(FIRST_TURN) - (len(FIRST_TURN) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert prefill == (len(FIRST_TURN) + 2 * last_block if caching else 3 * len(FIRST_TURN))
    assert len({tuple(c.token_ids) for c in gen.choices}) == 1


#: (backend kwargs, config kwargs): a roomy cache; KV for one 112-token context, chunked
REAL_VARIANTS = {
    "roomy": ({"kv_cache_gb": 0.25, "max_model_len": 512}, {"max_num_batched_tokens": 512}),
    "small-kv-chunked": (
        {"max_model_len": 112, "max_num_seqs": 1},
        {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
    ),
}


@pytest.mark.real_model
@pytest.mark.parametrize("variant", list(REAL_VARIANTS))
@pytest.mark.parametrize("scheduler", ["orca", "static", "lpm"])
def test_default_model_system_prompt_and_second_turn_equal_hf_generate(
    scheduler: str, variant: str
) -> None:
    backend_kwargs, config_kwargs = REAL_VARIANTS[variant]
    backend = TorchBackend.load(
        "default",
        device="cpu",
        dtype="float32",
        quantization="none",
        **backend_kwargs,  # type: ignore[arg-type]
    )
    tokenizer = backend.tokenizer

    def chat(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def hf(prompt: list[int], max_tokens: int) -> list[int]:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = backend.hf_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return list(out[0, len(prompt) :].tolist())

    system = {
        "role": "system",
        "content": "You are a careful assistant for a travel agency. Answer briefly, in one "
        "or two sentences, and name the country when you name a city.",
    }
    first = [system, {"role": "user", "content": "What is the capital of France?"}]
    config = SchedulerConfig(max_num_seqs=4, enable_prefix_caching=True, **config_kwargs)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=12, temperature=0.0)  # stops at EOS, as a chat does
    with LLM(backend, scheduler, config) as llm:
        [turn1] = llm.generate([chat(first)], params)
        answer = turn1.choices[0]
        second = [*first, {"role": "assistant", "content": answer.text}]
        second.append({"role": "user", "content": "And of Italy?"})
        other = [system, {"role": "user", "content": "Name a city in Japan."}]
        prompts = [chat(second), chat(other)]
        gens = llm.generate(prompts, params)
    # the next turn re-tokenizes the answer to the ids that were sampled: its hit covers
    # the whole first turn's full blocks, prompt and answer
    history = chat(first) + answer.token_ids
    assert prompts[0][: len(history)] == history
    bs = backend.kv_cache.block_size
    assert gens[0].choices[0].num_cached_tokens == (len(history) - 1) // bs * bs
    shared = next(
        i for i, (a, b) in enumerate(zip(prompts[1], chat(first), strict=False)) if a != b
    )
    assert gens[1].choices[0].num_cached_tokens == shared // bs * bs > 0
    for gen, prompt in zip(gens, prompts, strict=True):
        expect = hf(prompt, 12)
        assert gen.choices[0].token_ids == expect[: len(gen.choices[0].token_ids)]
    if variant != "roomy" and scheduler != "static":
        assert llm.engine.scheduler.num_preemptions > 0
