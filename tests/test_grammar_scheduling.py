"""Output grammars in the scheduler and the engine.

First every policy with no weights: a sequence whose grammar is still compiling is not
scheduled (the others run meanwhile), it starts once the grammar is ready, the grammar's end
finishes it with `stop`, a failed compile finishes it with the compiler's error, and a token
the grammar forbids finishes it with an error; KV blocks are all free afterwards.

Then the whole engine over a tiny random model (byte tokenizer, a vocabulary padded past it)
and over the default model: JSON-schema-constrained outputs at temperature 1 parse and
validate under every policy, with n > 1, chunked prefill, forced preemption, logprobs,
logit bias, penalties and stop strings; a grammar still compiling holds no KV while other
requests run; finish and abort free every block.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
import torch
from transformers import PreTrainedModel

from backends.sim import SimBackend
from backends.torch.runner.backend import TorchBackend
from backends.torch.sample import grammar_mask
from backends.torch.sample.grammar_mask import allocate_bitmask
from backends.torch.testing.tiny_models import BLOCK_SIZE, VOCAB, tiny_model, tiny_tokenizer
from schedulers.base import AdmissionError, Scheduler, SchedulerConfig
from schedulers.batch import ExecuteOutput
from schedulers.engine import Engine
from schedulers.llm import LLM, Choice
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import FinishReason, Sequence, TokenLogprob
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarErrorCode,
    GrammarSpec,
    SequenceGrammar,
)
from tests.schemas import PERSON
from tests.test_scheduler import ids, make_scheduler, make_seq

POLICIES = ["orca", "static", "lpm", "priority"]
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
#: "yes", then EOS: a complete output of the choice grammar
YES = [*TOKENIZER.encode("yes"), EOS]
#: neither "yes" nor "no" starts with "x"
FORBIDDEN = TOKENIZER.encode("x")[0]

GrammarFuture = Future[CompiledGrammar | GrammarError]


@pytest.fixture(scope="module")
def compiled() -> Iterator[CompiledGrammar]:
    compiler = GrammarCompiler(TOKENIZER, vocab_size=VOCAB, stop_token_ids=[EOS])
    result = compiler.compile(GrammarSpec.choice(["yes", "no"]))
    assert isinstance(result, CompiledGrammar), result
    yield result
    compiler.close()


def constrained(grammar: CompiledGrammar | GrammarFuture, max_tokens: int = 8) -> Sequence:
    seq = make_seq(6, max_tokens=max_tokens)
    seq.grammar = SequenceGrammar(grammar)
    return seq


def step(sched: Scheduler, token: Callable[[Sequence], int]) -> list[int]:
    """One iteration sampling `token(seq)` for each completed sequence; the ids scheduled."""
    batch = sched.schedule()
    sampled = {
        seq.seq_id: TokenLogprob(token(seq), 0.0)
        for i, seq in enumerate(batch.seqs)
        if batch.samples_after(i)
    }
    sched.update(batch, ExecuteOutput(sampled))
    return ids(batch)


def says_yes(seq: Sequence) -> int:
    """Constrained sequences write "yes" then EOS; others "x"."""
    return YES[seq.num_output_tokens] if seq.grammar is not None else FORBIDDEN


def steps_until(sched: Scheduler, done: Callable[[], bool]) -> list[list[int]]:
    steps = []
    for _ in range(100):
        if done():
            return steps
        steps.append(step(sched, says_yes))
    raise AssertionError("never done")


def all_free(sched: Scheduler) -> bool:
    return sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_a_sequence_whose_grammar_compiles_waits_while_others_run(
    policy: str, compiled: CompiledGrammar
) -> None:
    sched = make_scheduler(policy, max_num_seqs=4)
    pending: GrammarFuture = Future()
    waiting = constrained(pending)
    plain = make_seq(6, max_tokens=3)
    sched.add(waiting)
    sched.add(plain)
    before = steps_until(sched, lambda: plain.is_finished)
    assert before and all(waiting.seq_id not in batch for batch in before)
    assert plain.finish_reason is FinishReason.LENGTH
    assert not waiting.is_finished and waiting.block_table == []  # nothing allocated for it

    pending.set_result(compiled)
    after = steps_until(sched, lambda: not sched.has_work)
    assert any(waiting.seq_id in batch for batch in after)
    assert waiting.finish_reason is FinishReason.STOP, waiting.error  # the grammar ended
    assert waiting.output_token_ids == YES
    assert all_free(sched)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_token_the_grammar_forbids_finishes_the_sequence_with_an_error(
    policy: str, compiled: CompiledGrammar
) -> None:
    sched = make_scheduler(policy)
    seq = constrained(compiled)
    sched.add(seq)
    while sched.has_work:
        step(sched, lambda s: FORBIDDEN)
    assert seq.finish_reason is FinishReason.ERROR
    assert seq.error is not None and "not allowed" in seq.error
    assert seq.output_token_ids == [FORBIDDEN]
    assert seq.grammar is not None and seq.grammar.token_ids == []  # the state is unchanged
    assert all_free(sched)


def test_the_grammar_ending_finishes_with_stop_even_under_ignore_eos(
    compiled: CompiledGrammar,
) -> None:
    sched = make_scheduler("orca")
    seq = constrained(compiled, max_tokens=20)
    seq.sampling_params = dataclasses.replace(seq.sampling_params, ignore_eos=True)
    sched.add(seq)
    steps_until(sched, lambda: seq.is_finished)
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == YES
    assert seq.num_output_tokens < seq.sampling_params.max_tokens


def test_a_failed_compile_finishes_the_waiting_sequence_with_its_error() -> None:
    sched = make_scheduler("orca")
    pending: GrammarFuture = Future()
    seq = constrained(pending)
    sched.add(seq)
    assert step(sched, says_yes) == [] and sched.fail_grammar_errors() == []
    pending.set_result(GrammarError(GrammarErrorCode.TIMEOUT, "took too long"))
    assert sched.fail_grammar_errors() == [seq]
    assert seq.finish_reason is FinishReason.ERROR and seq.error == "took too long"
    assert seq.error_code == "grammar_compile_timeout"
    assert not sched.has_work and all_free(sched)


def test_static_forms_its_batch_without_a_compiling_request_and_takes_it_next(
    compiled: CompiledGrammar,
) -> None:
    sched = make_scheduler("static", max_num_seqs=4)
    pending: GrammarFuture = Future()
    waiting = constrained(pending)
    short, long = make_seq(6, max_tokens=2), make_seq(6, max_tokens=5)
    for seq in (short, waiting, long):
        sched.add(seq)
    assert set(step(sched, says_yes)) == {short.seq_id, long.seq_id}  # formed without it
    pending.set_result(compiled)  # ready while the batch runs: it joins no running batch
    during = steps_until(sched, lambda: long.is_finished)
    assert all(waiting.seq_id not in batch for batch in during)
    after = steps_until(sched, lambda: not sched.has_work)
    assert after[0] == [waiting.seq_id]
    assert waiting.finish_reason is FinishReason.STOP and waiting.output_token_ids == YES
    assert all_free(sched)


# -- the engine over a tiny random model ------------------------------------------------------

#: a small schema whose outputs always fit in MAX_TOKENS byte tokens
SMALL = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "tag": {"enum": ["a", "bc"]},
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
    },
    "required": ["ok", "n", "tag"],
}
#: never complete within a few tokens: at least 40 items
ENDLESS = {"type": "array", "items": {"type": "boolean"}, "minItems": 40}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def tiny() -> PreTrainedModel:
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = None  # EOS is the tokenizer's <eos> only
    return model


def tiny_llm(
    model: PreTrainedModel,
    scheduler: str = "orca",
    config: SchedulerConfig | None = None,
    kv_seqs: int = 16,
    max_model_len: int = 128,
    policy_options: dict[str, Any] | None = None,
) -> LLM:
    """An LLM over `model` with KV for `kv_seqs` full-length sequences."""
    backend = TorchBackend(
        model,
        tiny_tokenizer(),
        device="cpu",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=kv_seqs,
    )
    return LLM(backend, scheduler, config or SchedulerConfig(max_num_seqs=8), policy_options)


def compile_schema(llm: LLM, schema: dict[str, Any]) -> CompiledGrammar:
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    result = compiler.submit(GrammarSpec.json_schema(schema)).result(timeout=30)
    assert isinstance(result, CompiledGrammar), result
    return result


def assert_valid(choice: Choice, schema: dict[str, Any], eos: int) -> None:
    """The choice ended with its grammar: `stop` on EOS, and its text validates."""
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.error, choice.text)
    assert choice.token_ids[-1] == eos
    jsonschema.validate(json.loads(choice.text), schema)


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def soon_all_blocks_free(llm: LLM) -> bool:
    """All blocks free within 5 s (a stop string or an abort reaches the engine after the
    client has seen the end)."""
    deadline = time.monotonic() + 5
    while not all_blocks_free(llm) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all_blocks_free(llm)


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(count)]


@pytest.mark.parametrize("policy", POLICIES)
def test_constrained_choices_validate_at_temperature_1_beside_free_ones(
    tiny: PreTrainedModel, policy: str
) -> None:
    options = {"batch_wait_ms": 20.0} if policy == "static" else None
    with tiny_llm(tiny, policy, policy_options=options) as llm:
        grammar = compile_schema(llm, SMALL)
        constrained = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=2, grammar=grammar)
            for seed in range(3)
        ]
        free = [SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)] * 2
        gens = llm.generate(random_prompts(5, 7), [*constrained, *free])
        for gen in gens[:3]:
            for choice in gen.choices:
                assert_valid(choice, SMALL, EOS)
        assert [len(g.choices[0].token_ids) for g in gens[3:]] == [12, 12]
        assert all_blocks_free(llm)


def test_chunked_prefill_and_preemption_keep_the_matcher_in_step(tiny: PreTrainedModel) -> None:
    # KV for one 128-token context; six 40-token prompts, prefilled 16 tokens at a time
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, enable_chunked_prefill=True)
    with tiny_llm(tiny, "orca", config, kv_seqs=1) as llm:
        grammar = compile_schema(llm, SMALL)
        params = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=grammar)
            for seed in range(6)
        ]
        gens = llm.generate(random_prompts(6, 40, seed=1), params)
        for gen in gens:
            assert_valid(gen.choices[0], SMALL, EOS)
        assert llm.engine.scheduler.num_preemptions > 0
        assert any(r.num_prefill_tokens and r.num_decode_tokens for r in llm.engine.trace)
        assert all_blocks_free(llm)


def test_every_sampling_parameter_stays_inside_the_grammar(tiny: PreTrainedModel) -> None:
    tokenizer = tiny_tokenizer()
    brace = tokenizer.encode("}")[0]
    quote = tokenizer.encode("x")[0]
    with tiny_llm(tiny) as llm:
        grammar = compile_schema(llm, SMALL)
        base = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, grammar=grammar)
        variants = [
            dataclasses.replace(base, top_k=3, seed=1),
            dataclasses.replace(base, top_p=0.5, seed=2),
            dataclasses.replace(base, min_p=0.2, seed=3),
            dataclasses.replace(base, temperature=0.0),
            dataclasses.replace(base, repetition_penalty=1.5, presence_penalty=1.0, seed=4),
            dataclasses.replace(base, frequency_penalty=2.0, seed=5),
            # a bias that would force a token the grammar forbids almost everywhere
            dataclasses.replace(base, logit_bias={quote: 100.0, brace: 100.0}, seed=6),
            dataclasses.replace(base, ignore_eos=True, seed=7),
        ]
        gens = llm.generate(random_prompts(len(variants), 5, seed=2), variants)
        for gen in gens:
            assert_valid(gen.choices[0], SMALL, EOS)


def test_logprobs_are_those_of_the_masked_distribution(tiny: PreTrainedModel) -> None:
    with tiny_llm(tiny) as llm:
        compiler = llm.engine.grammar_compiler
        assert compiler is not None
        grammar = compiler.submit(GrammarSpec.choice(["yes", "no"])).result(timeout=30)
        assert isinstance(grammar, CompiledGrammar)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, logprobs=4, grammar=grammar)
        (gen,) = llm.generate([[5, 6, 7]], params)
    choice = gen.choices[0]
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no")
    first = choice.logprobs[0]
    allowed = {t for t, lp in first.top if lp > -math.inf}
    assert allowed == set(TOKENIZER.encode("y") + TOKENIZER.encode("n"))  # only "y" and "n"
    assert sum(math.exp(lp) for _, lp in first.top) == pytest.approx(1.0, abs=1e-5)
    for step in choice.logprobs[1:-1]:  # inside a word: one allowed token, probability 1
        assert step.logprob == pytest.approx(0.0, abs=1e-6)


def test_stop_strings_and_max_tokens_cut_a_constrained_output(tiny: PreTrainedModel) -> None:
    with tiny_llm(tiny) as llm:
        small = compile_schema(llm, SMALL)
        endless = compile_schema(llm, ENDLESS)
        cut, stopped = llm.generate(
            [[1, 2], [3, 4]],
            [
                SamplingParams(max_tokens=10, temperature=1.0, seed=0, grammar=endless),
                SamplingParams(max_tokens=MAX_TOKENS, stop=('"n"',), grammar=small),
            ],
        )
        assert cut.choices[0].finish_reason == "length"
        assert len(cut.choices[0].token_ids) == 10 and cut.choices[0].text.startswith("[")
        assert stopped.choices[0].finish_reason == "stop"
        text = stopped.choices[0].text
        assert text.startswith('{"ok": ') and '"n"' not in text
        assert soon_all_blocks_free(llm)


class Collected:
    """Everything the engine sent for one request (its sink runs on the engine thread)."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]


def test_the_engine_runs_others_while_a_grammar_compiles_and_never_holds_its_kv(
    tiny: PreTrainedModel,
) -> None:
    with tiny_llm(tiny) as llm:
        engine = llm.engine
        grammar = compile_schema(llm, SMALL)
        pending: GrammarFuture = Future()
        waiting, plain = Collected(), Collected()
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0, n=2)
        engine.submit("waits", [1, 2, 3], dataclasses.replace(params, grammar=pending), waiting)
        engine.submit("plain", [4, 5], SamplingParams(max_tokens=6, ignore_eos=True), plain)
        assert plain.done.wait(30) and len(plain.token_ids) == 6
        assert waiting.outputs == [] and engine.num_waiting == 2  # both choices wait, no KV
        assert all_blocks_free(llm)
        pending.set_result(grammar)  # the loop is asleep: resolving the future wakes it
        assert waiting.done.wait(30) or waiting.outputs[-1].finished
        for _ in range(100):  # the second choice's last output follows the first's
            if sum(out.finished for out in waiting.outputs) == 2:
                break
            time.sleep(0.05)
        texts = {0: "", 1: ""}
        for out in waiting.outputs:
            texts[out.index] += TOKENIZER.decode(out.token_ids, skip_special_tokens=True)
        for text in texts.values():
            jsonschema.validate(json.loads(text), SMALL)
        assert all(o.finish_reason == "stop" for o in waiting.outputs if o.finished)
        assert all_blocks_free(llm)


def test_a_failed_compile_ends_every_choice_with_its_code_and_no_kv(
    tiny: PreTrainedModel,
) -> None:
    with tiny_llm(tiny) as llm:
        pending: GrammarFuture = Future()
        failed = Collected()
        params = SamplingParams(max_tokens=8, n=2, grammar=pending)
        llm.engine.submit("fails", [1, 2, 3], params, failed)
        time.sleep(0.1)
        pending.set_result(GrammarError(GrammarErrorCode.UNSUPPORTED, "`not` is not enforced"))
        for _ in range(100):
            if sum(out.finished for out in failed.outputs) == 2:
                break
            time.sleep(0.05)
        assert [(o.finish_reason, o.error_code, o.error) for o in failed.outputs] == [
            ("error", "unsupported_grammar_feature", "`not` is not enforced")
        ] * 2
        assert failed.token_ids == [] and all_blocks_free(llm)


def test_aborting_a_constrained_request_frees_its_blocks(tiny: PreTrainedModel) -> None:
    with tiny_llm(tiny) as llm:
        grammar = compile_schema(llm, ENDLESS)
        streaming = Collected()
        params = SamplingParams(max_tokens=100, temperature=1.0, seed=0, n=2, grammar=grammar)
        llm.engine.submit("long", [1, 2, 3, 4, 5], params, streaming)
        for _ in range(200):
            if len(streaming.token_ids) >= 10:
                break
            time.sleep(0.01)
        assert not all_blocks_free(llm)
        llm.engine.abort("long")
        assert streaming.done.wait(30)
        assert soon_all_blocks_free(llm)
        assert {o.finish_reason for o in streaming.outputs if o.finished} == {"abort"}


def test_a_backend_that_cannot_mask_refuses_a_grammar(compiled: CompiledGrammar) -> None:
    engine = Engine(SimBackend())
    engine.start()
    try:
        assert engine.grammar_compiler is None
        with pytest.raises(AdmissionError) as refused:
            engine.submit("r", [1], SamplingParams(grammar=compiled), Collected())
        assert refused.value.code == "structured_outputs_unsupported"
    finally:
        engine.stop()


# -- the engine over the default model --------------------------------------------------------

QUESTIONS = [
    "Describe a fictional person as JSON.",
    "Who is the admin of this website? Answer in JSON.",
    "Give me a user profile.",
    "Make up somebody, with a few tags.",
]


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered)


@pytest.fixture(scope="module")
def default_backend() -> TorchBackend:
    return TorchBackend.load(
        "default", device="cpu", dtype="float32", kv_cache_gb=0.25, max_model_len=512
    )


@pytest.mark.real_model
@pytest.mark.parametrize("policy", ["orca", "static"])
def test_default_model_schema_outputs_validate_at_temperature_1(
    default_backend: TorchBackend, policy: str
) -> None:
    tokenizer = default_backend.tokenizer
    options = {"batch_wait_ms": 50.0} if policy == "static" else None
    with LLM(default_backend, policy, SchedulerConfig(max_num_seqs=8), options) as llm:
        grammar = compile_schema(llm, PERSON)
        params = [
            SamplingParams(max_tokens=120, temperature=1.0, seed=seed, n=2, grammar=grammar)
            for seed in range(len(QUESTIONS))
        ]
        free = SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
        prompts_ = [chat_prompt(tokenizer, q) for q in QUESTIONS]
        gens = llm.generate([*prompts_, prompts_[0]], [*params, free])
        eos = tokenizer.eos_token_id
        for gen in gens[:-1]:
            for choice in gen.choices:
                assert_valid(choice, PERSON, eos)
        assert len(gens[-1].choices[0].token_ids) == 16
        assert all_blocks_free(llm)


@pytest.mark.real_model
def test_default_model_schema_outputs_survive_chunked_prefill_preemption_and_abort() -> None:
    # KV for one 256-token context: four ~150-token requests must preempt one another
    backend = TorchBackend.load(
        "default",
        device="cpu",
        dtype="float32",
        kv_cache_gb=0.25,
        max_model_len=256,
        max_num_seqs=1,
    )
    tokenizer = backend.tokenizer
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, enable_chunked_prefill=True)
    with LLM(backend, "orca", config) as llm:
        grammar = compile_schema(llm, PERSON)
        endless = compile_schema(
            llm, {"type": "array", "items": {"type": "integer"}, "minItems": 99}
        )
        aborted = Collected()
        llm.engine.submit(
            "aborted",
            chat_prompt(tokenizer, "Count."),
            SamplingParams(max_tokens=150, temperature=1.0, grammar=endless),
            aborted,
        )
        deadline = time.monotonic() + 60
        while len(aborted.token_ids) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        llm.engine.abort("aborted")
        params = [
            SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar)
            for seed in range(len(QUESTIONS))
        ]
        gens = llm.generate([chat_prompt(tokenizer, q) for q in QUESTIONS], params)
        for gen in gens:
            assert_valid(gen.choices[0], PERSON, tokenizer.eos_token_id)
        assert llm.engine.scheduler.num_preemptions > 0
        assert aborted.done.wait(30)
        assert soon_all_blocks_free(llm)


def test_the_sampler_allocates_one_bitmask_and_none_for_free_batches(
    tiny: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes: list[tuple[int, ...]] = []

    def counting(num_rows: int, vocab_size: int) -> torch.Tensor:
        bitmask = allocate_bitmask(num_rows, vocab_size)
        shapes.append(tuple(bitmask.shape))
        return bitmask

    monkeypatch.setattr(grammar_mask, "allocate_bitmask", counting)
    with tiny_llm(tiny, kv_seqs=16) as llm:
        free = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
        llm.generate(random_prompts(3, 5), free)
        assert shapes == []  # unconstrained batches never touch the grammar step
        grammar = compile_schema(llm, SMALL)
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=1, n=2, grammar=grammar
        )
        gens = llm.generate(random_prompts(3, 5, seed=3), [params, params, free])
        assert [c.finish_reason for g in gens for c in g.choices] == ["stop"] * 4 + ["length"]
    assert shapes == [(16, math.ceil(VOCAB / 32))]  # once, for max_num_seqs rows
