"""Speculative decoding through the engine: sampled output keeps the target's distribution
(seeded chi-square on a tiny model's first tokens, with and without speculation), greedy
logprobs equal plain decoding's, stop strings cut inside a multi-token output exactly where
plain decoding stops, an abort while a step verifies drafts frees every block, and requests
with an output grammar beside speculating ones stay valid.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import math
import threading
from typing import Any

import jsonschema
import pytest
import torch
from scipy.stats import chi2
from transformers import PreTrainedModel

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.base import SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.client import open_stream
from schedulers.engine import Engine
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from tests.spec_workload import SPEC, spec_prompts
from tests.test_oracle import MATE_SCHEMA, with_constrained_mates


@pytest.fixture(scope="module")
def mistral() -> PreTrainedModel:
    """The sliding-window model: it repeats its own continuation, so it accepts many drafts."""
    model = tiny_model("mistral")
    model.generation_config.eos_token_id = None
    return model


def make_backend(model: PreTrainedModel, max_num_seqs: int = 64) -> TorchBackend:
    return TorchBackend(
        model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=128,
        max_num_seqs=max_num_seqs,
    )  # fmt: skip


def config(spec: bool, **fields: Any) -> SchedulerConfig:
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 512, **fields}
    return SchedulerConfig(speculative_config=SPEC if spec else None, **fields)


def accepted(llm: LLM) -> int:
    drafter = llm.engine.scheduler.drafter
    return 0 if drafter is None else drafter.stats.num_accepted_tokens


# -- sampling keeps the target distribution ---------------------------------------------------

SPAN = [40, 41, 42]
PROMPT = SPAN * 6 + SPAN[:2]  # prompt lookup drafts 42, 40, 41, ... after it
BIAS = {t: 10.0 for t in SPAN}  # so the drafts are likely, and the test exercises acceptance
TOP_K = 2
NUM_TOKENS = 4
NUM_SAMPLES = 4000
REQUESTS = 40


def target_joint(model: PreTrainedModel) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS tokens) as the sampler defines it: HF's fp32 logits, plus the bias,
    top-k, softmax at temperature 1 (every sequence of tokens in the top-k at each step)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    bias = torch.zeros(model.config.vocab_size)
    bias[list(BIAS)] = torch.tensor(list(BIAS.values()))
    for _ in range(NUM_TOKENS):
        grown = {}
        for prefix, p in joint.items():
            with torch.inference_mode():
                logits = model(torch.tensor([[*PROMPT, *prefix]])).logits[0, -1].float() + bias
            top = logits.topk(TOP_K)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                grown[(*prefix, token)] = p * q
        joint = grown
    return joint


def sampled_joint(model: PreTrainedModel, spec: bool) -> tuple[collections.Counter[Any], int]:
    """Counts of the first NUM_TOKENS tokens of NUM_SAMPLES seeded choices; draft tokens
    accepted on the way."""
    params = [
        SamplingParams(
            max_tokens=NUM_TOKENS, temperature=1.0, top_k=TOP_K, logit_bias=BIAS, ignore_eos=True,
            n=NUM_SAMPLES // REQUESTS, seed=1000 * r,
        )
        for r in range(REQUESTS)
    ]  # fmt: skip
    with LLM(make_backend(model), "orca", config(spec, max_num_seqs=64)) as llm:
        gens = llm.generate([PROMPT] * REQUESTS, params)
        counts = collections.Counter(tuple(c.token_ids) for g in gens for c in g.choices)
        return counts, accepted(llm)


def chi_square_p(counts: collections.Counter[Any], joint: dict[tuple[int, ...], float]) -> float:
    """The p-value of `counts` under `joint`, cells expected below 5 pooled into one."""
    total = sum(counts.values())
    assert set(counts) <= set(joint), "a sample outside the top-k support"
    big = [cell for cell, p in joint.items() if p * total >= 5]
    observed = [counts[c] for c in big] + [total - sum(counts[c] for c in big)]
    expected = [joint[c] * total for c in big] + [total * (1 - sum(joint[c] for c in big))]
    cells = [(o, e) for o, e in zip(observed, expected, strict=True) if e > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    return float(chi2.sf(statistic, len(cells) - 1))


def test_sampled_output_keeps_the_target_distribution(mistral: PreTrainedModel) -> None:
    joint = target_joint(mistral)
    for spec in (False, True):
        counts, num_accepted = sampled_joint(mistral, spec)
        assert sum(counts.values()) == NUM_SAMPLES
        assert chi_square_p(counts, joint) > 1e-3, (spec, counts.most_common(8))
        if spec:  # drafts were verified and many accepted: the rejection rule was exercised
            assert num_accepted > NUM_SAMPLES // 4


# -- logprobs, stop strings -----------------------------------------------------------------


def test_greedy_logprobs_with_speculation_equal_plain_decodings(mistral: PreTrainedModel) -> None:
    prompts = spec_prompts(mistral)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = []
    for spec in (False, True):
        with LLM(make_backend(mistral), "orca", config(spec)) as llm:
            runs.append([g.choices[0] for g in llm.generate(prompts, params)])
            if spec:
                assert accepted(llm) > 0
    for plain, fast in zip(*runs, strict=True):
        assert fast.token_ids == plain.token_ids
        assert len(fast.logprobs) == len(plain.logprobs) == 24
        for a, b in zip(fast.logprobs, plain.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(
                math.isclose(x, y, abs_tol=1e-4)
                for (_, x), (_, y) in zip(a.top, b.top, strict=True)
            )


async def chunks_of(engine: Engine, prompt: list[int], params: SamplingParams) -> list[Any]:
    stream = open_stream(engine, f"s{id(params)}", [prompt], params)
    try:
        return [output async for _, output in stream]
    finally:
        stream.close()


def token_text(chunks: list[Any]) -> tuple[str, list[int]]:
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def test_a_stop_string_inside_a_multi_token_output_cuts_it_as_plain_decoding_does() -> None:
    """A letters prompt biased to letters (llama loops on them and accepts drafts): every
    substring of up to 3 characters of its answer, as a stop string, gives with speculation
    plain decoding's text, tokens, finish reason and token count; at least one stop fell
    inside an output of several tokens (verified drafts)."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    letters = tiny_tokenizer().encode("abcdefg")
    prompt = letters * 5
    base = SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias={t: 10.0 for t in letters}
    )
    engines = {spec: Engine(make_backend(model, 8), "orca", config(spec)) for spec in (0, 1)}
    for engine in engines.values():
        engine.start()
    try:
        whole = asyncio.run(chunks_of(engines[1], prompt, base))
        text, _ = token_text(whole)
        ends = list(itertools.accumulate(len(c.token_ids) for c in whole))
        stops = {text[i : i + n] for n in (1, 2, 3) for i in range(len(text) - n + 1)}
        inside = 0
        for stop in sorted(stops):
            params = dataclasses.replace(base, stop=(stop,))
            plain, fast = (asyncio.run(chunks_of(engines[s], prompt, params)) for s in (0, 1))
            assert token_text(fast) == token_text(plain), stop
            assert fast[-1].finish_reason == plain[-1].finish_reason == "stop"
            assert fast[-1].num_output_tokens == plain[-1].num_output_tokens
            cut = len(token_text(fast)[1])
            inside += any(a < cut < b for a, b in itertools.pairwise([0, *ends]))
        assert inside, "no stop string fell inside a multi-token output"
        assert engines[1].scheduler.drafter.stats.num_accepted_tokens > 0  # type: ignore[union-attr]
    finally:
        for engine in engines.values():
            engine.stop()


# -- abort, grammar ---------------------------------------------------------------------------


class HeldVerify(TorchBackend):
    """Holds the first step that verifies drafts until the test lets it go."""

    verifying = threading.Event()
    go = threading.Event()

    def execute(self, batch: Batch) -> ExecuteOutput:
        if batch.num_draft_tokens and not self.verifying.is_set():
            self.verifying.set()
            assert self.go.wait(30)
        return super().execute(batch)


def test_an_abort_while_a_step_verifies_drafts_frees_every_block(
    mistral: PreTrainedModel,
) -> None:
    backend = HeldVerify(
        mistral, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=128,
        max_num_seqs=8,
    )  # fmt: skip
    engine = Engine(backend, "orca", config(True, enable_prefix_caching=True))
    engine.start()
    outputs: list[Any] = []
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        engine.submit("a", spec_prompts(mistral)[3], params, outputs.append)
        assert HeldVerify.verifying.wait(30)
        bm = engine.block_manager
        assert bm.num_free_blocks < bm.num_blocks
        engine.abort("a")
        HeldVerify.go.set()
        for _ in range(300):
            if outputs and outputs[-1].finish_reason:
                break
            threading.Event().wait(0.01)
        assert outputs[-1].finish_reason == "abort"
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants([])
    finally:
        HeldVerify.go.set()
        engine.stop()


def test_constrained_requests_beside_speculating_ones_stay_valid(
    mistral: PreTrainedModel,
) -> None:
    prompts = spec_prompts(mistral)[:4]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    with LLM(make_backend(mistral), "orca", config(True)) as llm:
        plain = [llm.generate([p], params[:1])[0].choices[0].token_ids for p in prompts]
        outputs, texts = with_constrained_mates(llm, prompts, params, [0.0] * 4)
        assert outputs == plain
        for text in texts:
            jsonschema.validate(json.loads(text), MATE_SCHEMA)
        assert accepted(llm) > 0


def test_the_engine_hands_the_backends_fast_rows_to_the_drafter(mistral: PreTrainedModel) -> None:
    backend = TorchBackend(
        mistral, tiny_tokenizer(), device="cpu", dtype="bfloat16", kv_cache_gb=0.01,
        max_model_len=64, quantization="int8", quantization_max_rows=4,
    )  # fmt: skip
    engine = Engine(backend, "orca", config(True))
    try:
        drafter = engine.scheduler.drafter
        assert drafter is not None and backend.fast_rows is not None
        assert drafter.fast_rows == backend.fast_rows and drafter.fast_rows.rows == 4
    finally:
        engine.stop()
