"""Speculative decoding's oracle: greedy output with prompt-lookup drafts verified in the step
is token for token Hugging Face `generate` on each prompt alone (fp32, every tiny
architecture, orca and static), with drafts measured to have been accepted; the same beside
chunked prefill, a prefix-cache hit and preemptions; a verifying row's logits at each position
are plain decoding's on every attention path; and on the CPU kernels a step of decodes that
verifies drafts still runs in the native decode stack.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import ARCHITECTURES, BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.base import SchedulerConfig
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.attention_fixture import EnginePath, engine_path_fixture  # noqa: F401
from tests.spec_workload import DELAYS_S, MAX_TOKENS, SPEC, spec_prompts
from tests.test_oracle import hf_greedy


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    model = tiny_model(request.param)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def prompts(arch_model: PreTrainedModel) -> list[list[int]]:
    return spec_prompts(arch_model)


@pytest.fixture(scope="module")
def expected(arch_model: PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(arch_model, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]


def make_backend(model: PreTrainedModel, **fields: Any) -> TorchBackend:
    fields = {"max_model_len": 128, "max_num_seqs": 64, **fields}
    return TorchBackend(model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, **fields)


def run(
    backend: TorchBackend,
    scheduler: str,
    config: SchedulerConfig,
    prompts: list[list[int]],
    delays_s: list[float] = DELAYS_S,
) -> tuple[list[list[int]], LLM]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    llm = LLM(backend, scheduler, config, {"batch_wait_ms": 20})
    try:
        gens = llm.generate(prompts, params, delays_s=delays_s)
    finally:
        llm.close()
    return [g.choices[0].token_ids for g in gens], llm


def check_drafts_accepted_and_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.scheduler.drafter.stats  # type: ignore[union-attr]
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    verified = [r for r in engine.trace if r.num_drafts]
    assert sum(r.num_accepted_tokens for r in verified) == stats.num_accepted_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_greedy_with_speculation_equals_hf_generate_alone(
    arch_model: PreTrainedModel,
    prompts: list[list[int]],
    expected: list[list[int]],
    scheduler: str,
) -> None:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=True,
        speculative_config=SPEC,
    )  # fmt: skip
    outputs, llm = run(make_backend(arch_model), scheduler, config, prompts)
    assert outputs == expected
    check_drafts_accepted_and_blocks_free(llm)
    assert llm.engine.block_manager.prefix_cache_hits > 0


def test_chunked_prefill_a_prefix_hit_and_preemption_keep_greedy_outputs(
    arch_model: PreTrainedModel, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    # KV for one 80-token context (20 blocks): far less than the prompts need together
    backend = make_backend(arch_model, max_num_seqs=1, max_model_len=80)
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=16, enable_chunked_prefill=True,
        enable_prefix_caching=True, speculative_config=SPEC,
    )  # fmt: skip
    outputs, llm = run(backend, "orca", config, prompts, delays_s=[0.0] * len(prompts))
    assert outputs == expected
    check_drafts_accepted_and_blocks_free(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0


def with_blocks(bm: BlockManager, prompt: list[int], seq_id: int) -> Sequence:
    """A sequence of `prompt` holding blocks for it, nothing computed yet."""
    seq = Sequence(seq_id, f"r{seq_id}", list(prompt), SamplingParams(max_tokens=32))
    bm.allocate(seq, len(prompt))
    return seq


def test_a_verifying_row_beside_a_prefill_gives_plain_decodings_logits(
    arch_model: PreTrainedModel, engine_path: EnginePath
) -> None:
    """One step: sequence A verifies 3 drafts (its true greedy continuation, then a wrong one
    at the end) beside sequence B's whole prefill. Each of A's 4 positions gives the logits HF
    gives there, and B's last token too."""
    backend = make_backend(arch_model, **engine_path.kwargs())
    bm = BlockManager(backend.kv_cache_spec.num_blocks, BLOCK_SIZE)
    rng = random.Random(3)
    prompt_a = [rng.randrange(300) for _ in range(13)]
    prompt_b = [rng.randrange(300) for _ in range(9)]
    truth = hf_greedy(arch_model, prompt_a, 4)
    a = with_blocks(bm, prompt_a, 0)
    prefill = Batch(0)
    prefill.add(a, len(prompt_a))
    backend.logits(prefill)
    a.num_computed_tokens = len(prompt_a)
    a.output_token_ids.append(truth[0])
    drafts = [truth[1], truth[2], (truth[3] + 1) % 300]
    b = with_blocks(bm, prompt_b, 1)
    step = Batch(1)
    step.add(a, 1)
    bm.allocate(a, a.num_computed_tokens + 1 + len(drafts))
    step.add_drafts(0, drafts)
    step.add(b, len(prompt_b))
    got = backend.logits(step, [0, 1])  # (4 + 1, V)
    with torch.inference_mode():
        full = arch_model(torch.tensor([[*prompt_a, truth[0], *drafts]])).logits[0, -4:]
        last_b = arch_model(torch.tensor([prompt_b])).logits[0, -1:]
    want = torch.cat([full, last_b]).float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert got[:3].argmax(-1).tolist() == truth[1:4]


@pytest.mark.skipif(kernels.native() is None, reason="no CPU kernels here")
def test_steps_of_decodes_that_verify_drafts_run_in_the_native_decode_stack(
    arch_model: PreTrainedModel, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    backend = make_backend(arch_model, attention_backend="cpu_paged")
    native = backend.model.native_layers  # type: ignore[union-attr]
    if native is None:  # qwen3's Q/K norms: its decodes run the Python loop, with or without
        pytest.skip("the native decode stack does not run this architecture")
    calls: list[int] = []
    stack = native.stack

    class Counting:
        def forward(self, *args: Any) -> torch.Tensor:
            calls.append(args[0].shape[0])
            out: torch.Tensor = stack.forward(*args)
            return out

    native.stack = Counting()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, speculative_config=SPEC)
    outputs, llm = run(backend, "orca", config, prompts, delays_s=[0.0] * len(prompts))
    assert outputs == expected
    check_drafts_accepted_and_blocks_free(llm)
    decode_verifies = [r for r in llm.engine.trace if r.num_drafts and not r.num_prefill_tokens]
    assert decode_verifies
    # each such step ran in the stack, over one row per verified token
    rows = {r.num_decode_tokens + r.num_draft_tokens for r in decode_verifies}
    assert rows <= set(calls)
