"""Every policy and output grammars, with no weights: a sequence whose grammar is still
compiling is not scheduled (the others run meanwhile), it starts once the grammar is ready,
the grammar's end finishes it with `stop`, a failed compile finishes it with the compiler's
error, and a token the grammar forbids finishes it with an error; KV blocks are all free
afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from schedulers.base import Scheduler
from schedulers.batch import ExecuteOutput
from schedulers.sequence import FinishReason, Sequence, TokenLogprob
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarErrorCode,
    GrammarSpec,
    SequenceGrammar,
)
from tests.test_scheduler import ids, make_scheduler, make_seq
from tests.tiny_models import VOCAB, tiny_tokenizer

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
    import dataclasses

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
