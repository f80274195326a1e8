"""`batch_invariant` (vLLM's `VLLM_BATCH_INVARIANT`): a sequence's logits, and so its greedy
answer, do not depend on what else is in its steps (docs/batch-invariance.md).

Tiny models: one text's teacher-forced logits alone, and chunked beside other prefills and
decodes, are the very same bits. The real model (marked `real_model`): greedy answers to a few
chat prompts, each alone, and beside a busy batch of long requests, token for token, under
`orca` (chunked prefill and the prefix cache on) and `static`.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from backends.torch import kernels
from backends.torch.attention import create_backend
from backends.torch.attention.base import AttentionSpec
from backends.torch.config import TorchBackendConfig
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.inputs import build_layout
from backends.torch.testing.fixed_texts import PASSAGES, QUESTIONS
from backends.torch.testing.tiny_models import (
    ARCHITECTURES,
    TINY,
    VOCAB,
    tiny_model,
    tiny_tokenizer,
)
from schedulers.base import SchedulerConfig
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no Carousel CPU kernels")

#: a schedule: per step, the tokens each sequence gets (0: not in that step)
Schedule = list[list[int]]


def run_schedule(
    backend: TorchBackend, texts: list[list[int]], prompt_lens: list[int], schedule: Schedule
) -> dict[int, torch.Tensor]:
    """Teacher-force `texts` through the steps of `schedule`; sequence 0's logits by position."""
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompts = [t[:n] for t, n in zip(texts, prompt_lens, strict=True)]
    seqs = [Sequence(i, f"s{i}", p, params) for i, p in enumerate(prompts)]
    probe: dict[int, torch.Tensor] = {}
    for step in schedule:
        batch = Batch(0)
        for seq, n in zip(seqs, step, strict=True):
            if n:
                blocks.allocate(seq, seq.num_computed_tokens + n)
                batch.add(seq, n)
        logits = backend.logits(batch)
        for row, seq in enumerate(batch.seqs):
            n = batch.num_scheduled_tokens[row]
            seq.num_computed_tokens += n
            if seq.seq_id == 0:
                probe[seq.num_computed_tokens - 1] = logits[row]
            if seq.num_computed_tokens == seq.num_tokens:  # level: feed the true next token
                seq.output_token_ids.append(texts[seq.seq_id][seq.num_tokens])
    for seq in seqs:
        blocks.free(seq)
    return probe


def wide_llama() -> PreTrainedModel:
    """A tiny Llama wide enough (K = 512) that `F.linear`'s sums depend on its rows in fp32."""
    torch.manual_seed(0)
    dims = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    return LlamaForCausalLM(LlamaConfig(**dims))


def busy_schedule(num_others: int, decodes: int) -> Schedule:
    """The probe's 40-token prompt in two chunks (17 + 23) in steps of over 256 rows (past the
    packed linears' usual window), then `decodes` decodes each beside a 100-token prefill and
    the other sequences' decodes."""
    steps = [[17, 100, 100, 60] + [0] * (num_others - 3), [23, 1, 1, 40, 100, 100]]
    steps[1] += [0] * (num_others + 1 - len(steps[1]))
    for i in range(decodes):
        fresh = 6 + i  # sequences 6, 7, ... prefill beside the probe's decode i
        steps.append(
            [1] + [1 if j < fresh else 100 if j == fresh else 0 for j in range(1, 1 + num_others)]
        )
    return steps


def alone_and_busy(arch: str, dtype: str, decodes: int = 6) -> tuple[dict[int, torch.Tensor], ...]:
    """The probe's logits with its prompt prefilled whole and decoded alone, and in the steps
    of `busy_schedule`."""
    model = wide_llama() if arch == "wide-llama" else tiny_model(arch)
    backend = TorchBackend(
        model, tiny_tokenizer(), device="cpu", dtype=dtype, kv_cache_gb=0.05, batch_invariant=True
    )
    rng = random.Random(3)
    num_others = 5 + decodes
    texts = [[rng.randrange(VOCAB) for _ in range(120)] for _ in range(1 + num_others)]
    alone = run_schedule(backend, texts[:1], [40], [[40]] + [[1]] * decodes)
    busy = run_schedule(
        backend, texts, [40] + [100] * num_others, busy_schedule(num_others, decodes)
    )
    return alone, busy


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", [*ARCHITECTURES, "wide-llama"])
def test_a_sequences_logits_are_the_same_bits_alone_and_chunked_in_a_busy_step(
    arch: str, dtype: str
) -> None:
    if dtype == "bfloat16" and not kernels.computes(torch.bfloat16):
        pytest.skip("no bf16 CPU kernels here")
    alone, busy = alone_and_busy(arch, dtype)
    assert sorted(alone) == list(range(39, 46))
    for position, logits in alone.items():
        assert torch.equal(busy[position], logits), f"position {position}"


@needs_kernels
def test_every_token_attends_as_a_decode_over_its_own_context() -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=None)
    kv_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4,
                         dtype=torch.float32)  # fmt: skip
    cache = KVCache(kv_layout, num_blocks=8, device=torch.device("cpu"))
    backend = create_backend("auto", cache, [spec], torch.device("cpu"), batch_invariant=True)
    # a 3-token chunk after 5 cached tokens, a decode at 10 keys, a 2-token prompt
    layout = build_layout(
        torch.tensor([0, 3, 4, 6]), torch.tensor([8, 10, 2]), torch.arange(6),
        torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]]), 4, torch.device("cpu"),
    )  # fmt: skip
    meta = backend.build_metadata(layout)
    assert meta.all_decodes
    assert meta.context_lens.tolist() == [6, 7, 8, 10, 1, 2]
    assert meta.block_tables.tolist() == [[0, 1, 0]] * 3 + [[2, 3, 4]] + [[5, 0, 0]] * 2


@pytest.mark.parametrize(
    "fields",
    [
        {"quantization": "gguf"},
        {"compile": True},
        {"tensor_parallel_size": 2},
        {"cpu_kernels": False},
        {"attention_backend": "sdpa"},
    ],
)
def test_settings_that_choose_kernels_by_rows_are_refused_with_it(
    fields: dict[str, object],
) -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        TorchBackendConfig(batch_invariant=True, **fields)  # type: ignore[arg-type]


# the real model: greedy answers alone and beside a busy batch

PROMPTS = QUESTIONS[:4]
ANSWER = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BUSY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NUM_BUSY = 8


@pytest.fixture(scope="module")
def invariant_backend() -> TorchBackend:
    return TorchBackend.load(
        "default", device="cpu", kv_cache_gb=0.25, max_model_len=1024, batch_invariant=True
    )


def chat(backend: TorchBackend, question: str) -> list[int]:
    text = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(backend.tokenizer.encode(text))


def answers_alone_and_beside(
    backend: TorchBackend, scheduler: str, config: SchedulerConfig
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy answers to `PROMPTS`, each alone, then among `NUM_BUSY` long requests: arriving
    while those run (orca), or in one batch with them (static)."""
    prompts = [chat(backend, q) for q in PROMPTS]
    passage = list(backend.tokenizer.encode(" ".join(PASSAGES)))  # about 400 tokens
    busy = [passage[i * 7 :] for i in range(NUM_BUSY)]
    with LLM(backend, scheduler, config) as llm:
        alone = [llm.generate([p], ANSWER)[0].choices[0].token_ids for p in prompts]
        gap = 0.0 if scheduler == "static" else 0.02
        delays = [0.0] * NUM_BUSY + [gap * (i + 1) for i in range(len(prompts))]
        params = [BUSY] * NUM_BUSY + [ANSWER] * len(prompts)
        gens = llm.generate(busy + prompts, params, delays_s=delays)
    return alone, [g.choices[0].token_ids for g in gens[NUM_BUSY:]]


@pytest.mark.real_model
@needs_kernels
@pytest.mark.parametrize(
    "scheduler, config",
    [
        (
            "orca",
            SchedulerConfig(
                max_num_batched_tokens=512, enable_chunked_prefill=True, enable_prefix_caching=True
            ),
        ),
        ("static", SchedulerConfig(enable_prefix_caching=True)),
    ],
    ids=["orca", "static"],
)
def test_greedy_answers_are_the_same_alone_and_beside_a_busy_batch(
    invariant_backend: TorchBackend, scheduler: str, config: SchedulerConfig
) -> None:
    alone, beside = answers_alone_and_beside(invariant_backend, scheduler, config)
    assert all(len(answer) == ANSWER.max_tokens for answer in alone)
    assert beside == alone
