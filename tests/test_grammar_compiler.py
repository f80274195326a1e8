"""The grammar compiler (off-thread, cached, bounded) and per-sequence matcher state.

A byte-level tokenizer (256 byte tokens + `<eos>` + `<pad>`) keeps compiles fast; the model
side is 320 logits wide, so ids 258..319 are vocab padding.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from backends.torch.sample.grammar_mask import allocate_bitmask
from backends.torch.testing.tiny_models import VOCAB, tiny_tokenizer
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarErrorCode,
    GrammarLimits,
    GrammarSpec,
    SequenceGrammar,
)

OBJECT = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
#: optional properties cost xgrammar quadratic time: ~1-4 s to compile with this tokenizer
SLOW = GrammarSpec.json_schema(
    {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(1000)}}
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = tiny_tokenizer()
    tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def make_compiler(tokenizer: PreTrainedTokenizerFast, **kwargs: object) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id], **kwargs
    )


@pytest.fixture
def compiler(tokenizer: PreTrainedTokenizerFast) -> Iterator[GrammarCompiler]:
    grammar_compiler = make_compiler(tokenizer)
    yield grammar_compiler
    grammar_compiler.close()


def compiled(compiler: GrammarCompiler, spec: GrammarSpec) -> CompiledGrammar:
    result = compiler.compile(spec)
    assert isinstance(result, CompiledGrammar), result
    return result


def allowed(state: SequenceGrammar) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    state.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def walk(state: SequenceGrammar, tokenizer: PreTrainedTokenizerFast, text: str) -> bool:
    return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GrammarSpec.json_schema(OBJECT), '{"name": "ab", "n": 3}', '{"name": 3, "n": 3}'),
        (GrammarSpec.json_object(), '{"x": [1, null]}', "[1]"),
        (GrammarSpec.regex(r"\d{3}-(yes|no)"), "123-yes", "12-yes"),
        (GrammarSpec.choice(['say "hi"', "back\\slash"]), 'say "hi"', "say hi"),
        (GrammarSpec.grammar('root ::= "a" root | "b"'), "aab", "aba"),
    ],
)
def test_each_kind_accepts_what_it_should_and_nothing_else(
    compiler: GrammarCompiler,
    tokenizer: PreTrainedTokenizerFast,
    spec: GrammarSpec,
    good: str,
    bad: str,
) -> None:
    state = SequenceGrammar(compiled(compiler, spec))
    assert walk(state, tokenizer, good) and state.is_completed
    assert allowed(state) == {tokenizer.eos_token_id}  # complete: only the stop token
    assert state.accept(tokenizer.eos_token_id) and state.is_terminated
    assert not walk(SequenceGrammar(compiled(compiler, spec)), tokenizer, bad)


def test_json_is_decoded_in_one_compact_layout(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    grammar = compiled(compiler, GrammarSpec.json_schema(OBJECT))
    assert walk(SequenceGrammar(grammar), tokenizer, '{"name": "a", "n": 1}')
    assert not walk(SequenceGrammar(grammar), tokenizer, '{\n  "name": "a"')


def test_special_tokens_padding_ids_and_eos_are_never_allowed_inside_a_value(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = SequenceGrammar(compiled(compiler, GrammarSpec.json_schema({"type": "string"})))
    assert state.accept(tokenizer.encode('"')[0])
    inside_string = allowed(state)
    pad = tokenizer.pad_token_id
    assert pad is not None and pad not in inside_string  # `<pad>` is not the text "<pad>"
    assert tokenizer.eos_token_id not in inside_string
    assert not inside_string & set(range(258, VOCAB))  # padded ids beyond the tokenizer
    assert tokenizer.encode("a")[0] in inside_string


def test_length_bounded_strings_never_contain_raw_control_characters(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """xgrammar's own rule for minLength/maxLength admits raw control bytes (invalid JSON);
    the compiler rewrites it to an exact pattern."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "string", "minLength": 1, "maxLength": 5}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(raw, '"a\x01"')  # the bug worked around
    state = SequenceGrammar(compiled(compiler, GrammarSpec.json_schema(schema)))
    assert state.accept(tokenizer.encode('"')[0])
    control = {tokenizer.encode(chr(c))[0] for c in range(32)}
    assert not allowed(state) & control
    assert walk(state, tokenizer, 'héllo"') and state.is_completed  # 5 chars, 6 bytes
    too_long = SequenceGrammar(compiled(compiler, GrammarSpec.json_schema(schema)))
    assert not walk(too_long, tokenizer, '"abcdef"')
    spacious = make_compiler(tokenizer, any_whitespace=True)  # the other workaround
    try:
        array = GrammarSpec.json_schema({"type": "array", "items": schema})
        state = SequenceGrammar(compiled(spacious, array))
        assert walk(state, tokenizer, '[\n\t"')
        assert not allowed(state) & control
        assert walk(state, tokenizer, 'héllo"\n]') and state.is_completed
    finally:
        spacious.close()


def test_a_cached_grammar_is_returned_without_compiling_again(
    compiler: GrammarCompiler,
) -> None:
    first = compiled(compiler, GrammarSpec.json_schema(OBJECT))
    again = compiled(compiler, GrammarSpec.json_schema(json.dumps(OBJECT, indent=2)))
    assert again is first
    assert compiler.cached_bytes == first.memory_bytes


def test_the_cache_evicts_least_recently_used_grammars_to_stay_within_its_bytes(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    specs = [GrammarSpec.regex(f"{word}[0-9]+") for word in ("ab", "cd", "ef")]
    probe = make_compiler(tokenizer)
    size = max(compiled(probe, spec).memory_bytes for spec in specs)
    probe.close()
    small = make_compiler(tokenizer, cache_bytes=2 * size + size // 2)
    try:
        first = compiled(small, specs[0])
        second = compiled(small, specs[1])
        assert compiled(small, specs[0]) is first  # a hit makes specs[0] the most recent
        compiled(small, specs[2])  # evicts specs[1], the least recently used
        assert small.cached_bytes <= small.cache_bytes
        assert compiled(small, specs[0]) is first
        assert compiled(small, specs[1]) is not second  # compiled anew
    finally:
        small.close()


def test_concurrent_submits_of_one_spec_share_one_compile(compiler: GrammarCompiler) -> None:
    properties = {f"p{i}": {"type": "string"} for i in range(300)}  # ~0.1 s to compile
    spec = GrammarSpec.json_schema({"type": "object", "properties": properties})
    futures = [compiler.submit(spec) for _ in range(5)]
    assert len({id(f) for f in futures}) == 1  # in flight: the same future
    assert isinstance(futures[0].result(timeout=30), CompiledGrammar)


def test_invalid_specs_and_compile_errors_resolve_to_errors(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.json_schema({"not": {}})
    refused = compiler.submit(spec).result(timeout=30)  # checked on a worker
    assert isinstance(refused, GrammarError) and refused.code is GrammarErrorCode.UNSUPPORTED
    again = compiler.submit(spec)  # remembered
    assert again.done() and again.result() == refused
    error = compiler.compile(GrammarSpec.grammar("root ::= undefined_rule"))
    assert isinstance(error, GrammarError) and error.code is GrammarErrorCode.COMPILE
    assert "undefined_rule" in error.message and not re.match(r"^\[\d", error.message)


def test_a_compiled_grammar_over_the_size_limit_is_refused(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    strict = make_compiler(tokenizer, limits=GrammarLimits(max_grammar_bytes=1000))
    try:
        error = strict.compile(GrammarSpec.json_schema(OBJECT))
        assert isinstance(error, GrammarError) and error.code is GrammarErrorCode.TOO_LARGE
    finally:
        strict.close()


@pytest.fixture
def no_compiling_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar's compiler fails in this process (the compile children have their own)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a grammar was compiled outside a compile process")

    monkeypatch.setattr(xgr, "GrammarCompiler", refuse)


def test_a_grammar_over_the_hand_back_limit_is_refused_not_compiled_again(
    tokenizer: PreTrainedTokenizerFast, no_compiling_here: None
) -> None:
    strict = make_compiler(tokenizer, limits=GrammarLimits(max_handback_bytes=1000))
    try:
        error = strict.compile(GrammarSpec.json_schema(OBJECT))  # ~12 KB serialised
        assert isinstance(error, GrammarError) and error.code is GrammarErrorCode.TOO_LARGE
        assert "hand back" in error.message and "over the 1000 bytes limit" in error.message
    finally:
        strict.close()


def test_a_hand_back_that_overruns_the_deadline_is_refused_and_its_process_killed(
    tokenizer: PreTrainedTokenizerFast, no_compiling_here: None
) -> None:
    union = {"anyOf": [  # 2 MiB compiled in ~50 ms; its serialisation takes ~10 s
        {"type": "object", "required": [f"k{i}_0"],
         "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 40} for j in range(10)}}
        for i in range(50)
    ]}  # fmt: skip
    one = make_compiler(tokenizer, num_workers=1, limits=GrammarLimits(compile_timeout_s=1.0))
    try:
        one.warm_up().result(timeout=60)
        (first_pid,) = one.process_ids
        start = time.monotonic()
        error = one.compile(GrammarSpec.json_schema(union))
        assert time.monotonic() - start < 3
        assert isinstance(error, GrammarError) and error.code is GrammarErrorCode.TOO_LARGE
        assert "did not end within the 1 s limit" in error.message, error
        assert first_pid not in one.process_ids
        assert isinstance(one.compile(GrammarSpec.json_schema(OBJECT)), CompiledGrammar)
    finally:
        one.close()


def test_a_compile_process_that_dies_fails_its_compile_and_is_replaced(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    one = make_compiler(tokenizer, num_workers=1)
    try:
        one.warm_up().result(timeout=60)
        (pid,) = one.process_ids
        slow = one.submit(GrammarSpec.json_schema({"type": "string", "pattern": "^a{1,6000}$"}))
        time.sleep(0.3)  # the child is compiling (~1-3 s)
        os.kill(pid, signal.SIGKILL)
        error = slow.result(timeout=30)
        assert isinstance(error, GrammarError) and error.code is GrammarErrorCode.COMPILE
        assert "exited" in error.message, error
        assert isinstance(one.compile(GrammarSpec.json_schema(OBJECT)), CompiledGrammar)
        assert pid not in one.process_ids
    finally:
        one.close()


def test_a_slow_compile_times_out_at_its_deadline_without_stalling_other_compiles(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    slow = make_compiler(tokenizer, queue_timeout_s=30, limits=GrammarLimits(compile_timeout_s=0.3))
    try:
        slow.warm_up().result(timeout=60)
        start = time.monotonic()
        pending = slow.submit(SLOW)
        other = slow.compile(GrammarSpec.json_schema(OBJECT))  # the second worker is free
        assert isinstance(other, CompiledGrammar)
        result = pending.result(timeout=30)
        waited = time.monotonic() - start
        assert isinstance(result, GrammarError) and result.code is GrammarErrorCode.TIMEOUT
        assert waited < 1.5  # the deadline, not the ~1-4 s the compile takes
        again = slow.submit(SLOW)  # remembered: refused at once, not compiled again
        assert again.done() and again.result() == result
    finally:
        slow.close()


def test_an_overrunning_compile_is_killed_so_its_worker_is_free_at_once(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    one = make_compiler(tokenizer, num_workers=1, limits=GrammarLimits(compile_timeout_s=0.3))
    try:
        one.warm_up().result(timeout=60)
        (first_pid,) = one.process_ids
        timed_out = one.compile(SLOW)
        assert isinstance(timed_out, GrammarError)
        assert timed_out.code is GrammarErrorCode.TIMEOUT
        assert one.num_pending == 0  # nothing keeps running in the background
        assert first_pid not in one.process_ids
        start = time.monotonic()
        assert isinstance(one.compile(GrammarSpec.json_schema(OBJECT)), CompiledGrammar)
        assert time.monotonic() - start < 2  # the one worker took a fresh process at once
    finally:
        one.close()


def test_after_two_compile_timeouts_a_fresh_small_schema_compiles_within_2_s(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    # a 30 s queue bound: on a loaded 2-core machine a worker can take longer than the 0.3 s
    # compile deadline to pick its job up, and this test is about the compile deadline
    two = make_compiler(
        tokenizer,
        num_workers=2,
        queue_timeout_s=30,
        limits=GrammarLimits(compile_timeout_s=0.3),
    )
    try:
        two.warm_up().result(timeout=60)
        slow = [
            two.submit(GrammarSpec.json_schema({"type": "object", "properties": {
                f"{prefix}{i}": {"type": "string"} for i in range(2000)}}))
            for prefix in ("a", "b")
        ]  # fmt: skip
        for pending in slow:
            result = pending.result(timeout=30)
            assert isinstance(result, GrammarError) and result.code is GrammarErrorCode.TIMEOUT
        start = time.monotonic()
        fresh = two.submit(GrammarSpec.json_schema(OBJECT)).result(timeout=30)
        assert isinstance(fresh, CompiledGrammar), fresh
        assert time.monotonic() - start < 2.0
    finally:
        two.close()


def test_a_failed_schema_is_refused_at_once_however_its_text_is_varied(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    one = make_compiler(tokenizer, num_workers=1, limits=GrammarLimits(compile_timeout_s=0.3))
    try:
        properties = {f"f{i}": {"type": "string"} for i in range(1000)}
        first = one.compile(GrammarSpec.json_schema({"type": "object", "properties": properties}))
        assert isinstance(first, GrammarError) and first.code is GrammarErrorCode.TIMEOUT
        reordered = dict(reversed(list(properties.items())))
        varied = {"properties": reordered, "description": "another text", "type": "object"}
        again = one.submit(GrammarSpec.json_schema(varied))
        assert again.done() and again.result() == first
    finally:
        one.close()


def test_one_principal_has_at_most_its_cap_of_compiles_in_flight(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    capped = make_compiler(
        tokenizer,
        max_pending_per_principal=1,
        queue_timeout_s=30,
        limits=GrammarLimits(compile_timeout_s=0.3),
    )
    try:
        running = capped.submit(SLOW, "alice")
        refused = capped.submit(GrammarSpec.json_schema(OBJECT), "alice").result(timeout=1)
        assert isinstance(refused, GrammarError) and refused.code is GrammarErrorCode.BUSY
        other = capped.submit(GrammarSpec.json_schema(OBJECT), "bob").result(timeout=30)
        assert isinstance(other, CompiledGrammar)
        assert isinstance(running.result(timeout=30), GrammarError)
        later = capped.submit(GrammarSpec.regex("[0-9]+"), "alice").result(timeout=30)
        assert isinstance(later, CompiledGrammar)  # her slot is free again
        # every request of a keyless gateway is `anonymous`: bounded by max_pending only
        anonymous = [capped.submit(GrammarSpec.regex(f"[a-{c}]+")) for c in "bcd"]
        assert all(isinstance(f.result(timeout=30), CompiledGrammar) for f in anonymous)
    finally:
        capped.close()


def test_compiles_beyond_the_pending_bound_or_queued_too_long_are_busy(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    one = make_compiler(
        tokenizer,
        num_workers=1,
        max_pending=2,
        queue_timeout_s=0.2,
        limits=GrammarLimits(compile_timeout_s=0.2),
    )
    try:
        running = one.submit(SLOW)
        queued = one.submit(GrammarSpec.json_schema(OBJECT))
        refused = one.submit(GrammarSpec.regex("[0-9]+"))
        assert refused.done()
        refused_error = refused.result()
        assert isinstance(refused_error, GrammarError)
        assert refused_error.code is GrammarErrorCode.BUSY
        queued_result = queued.result(timeout=30)  # the worker is stuck on SLOW
        assert isinstance(queued_result, GrammarError)
        assert queued_result.code is GrammarErrorCode.BUSY
        running_result = running.result(timeout=30)
        assert isinstance(running_result, GrammarError)
        assert running_result.code is GrammarErrorCode.TIMEOUT
    finally:
        one.close()


def test_a_sequence_is_not_ready_until_its_grammar_compiled(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    future: Future[CompiledGrammar | GrammarError] = Future()
    state = SequenceGrammar(future)
    assert not state.is_ready() and state.error is None
    with pytest.raises(RuntimeError, match="not compiled"):
        state.accept(5)
    future.set_result(compiled(compiler, GrammarSpec.json_object()))
    assert state.is_ready() and walk(state, tokenizer, "{}")
    failed: Future[CompiledGrammar | GrammarError] = Future()
    failed.set_result(GrammarError(GrammarErrorCode.TIMEOUT, "slow"))
    broken = SequenceGrammar(failed)
    assert not broken.is_ready() and broken.error is not None


def test_a_rejected_token_leaves_the_state_unchanged(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = SequenceGrammar(compiled(compiler, GrammarSpec.json_schema(OBJECT)))
    assert walk(state, tokenizer, '{"na')
    before = allowed(state)
    assert not state.accept(tokenizer.encode("}")[0])
    assert allowed(state) == before and len(state.token_ids) == 4


def test_a_terminated_sequence_cannot_fill_a_bitmask(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = SequenceGrammar(compiled(compiler, GrammarSpec.choice(["ok"])))
    assert walk(state, tokenizer, "ok") and state.accept(tokenizer.eos_token_id)
    with pytest.raises(RuntimeError, match="terminated"):
        state.fill_bitmask(allocate_bitmask(1, VOCAB), 0)


def test_sync_matches_a_fresh_replay_after_the_output_is_kept_cut_or_replaced(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Preemption by recompute keeps the output (sync is a no-op); a cut output rolls back;
    a diverged one rolls back to the common prefix and replays the rest."""
    grammar = compiled(compiler, GrammarSpec.json_schema(OBJECT))
    output = tokenizer.encode('{"name": "abc", "n": 12', add_special_tokens=False)

    def fresh(tokens: list[int]) -> SequenceGrammar:
        state = SequenceGrammar(grammar)
        assert all(state.accept(t) for t in tokens)
        return state

    state = fresh(output)
    for target in (
        output,
        output[:5],
        output,
        tokenizer.encode('{"name": "x"', add_special_tokens=False),
    ):
        assert state.sync(target)
        assert state.token_ids == target
        assert allowed(state) == allowed(fresh(target))
        assert state.is_completed == fresh(target).is_completed
    assert not state.sync(tokenizer.encode('{"name": 5', add_special_tokens=False))


def test_fill_writes_only_its_own_row(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = SequenceGrammar(compiled(compiler, GrammarSpec.choice(["yes"])))
    bitmask = allocate_bitmask(3, VOCAB)
    state.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    assert bitmask[1].ne(-1).any()


def test_closing_answers_every_pending_compile_and_later_submits(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    closing = make_compiler(tokenizer, num_workers=1)
    running = closing.submit(SLOW)
    queued = closing.submit(GrammarSpec.json_schema(OBJECT))
    closing.close()
    for future in (running, queued, closing.submit(GrammarSpec.regex("[a-z]+"))):
        result = future.result(timeout=5)
        assert isinstance(result, GrammarError) and result.code is GrammarErrorCode.BUSY


def test_a_tokenizer_xgrammar_cannot_read_fails_the_compile_instead_of_hanging() -> None:
    unreadable = GrammarCompiler(object(), vocab_size=16)
    try:
        result = unreadable.submit(GrammarSpec.json_object()).result(timeout=10)
        assert isinstance(result, GrammarError) and result.code is GrammarErrorCode.COMPILE
        assert unreadable.num_pending == 0
    finally:
        unreadable.close()


def test_a_script_without_a_main_guard_compiles_without_running_again(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from backends.torch.testing.tiny_models import tiny_tokenizer\n"
        "from schedulers.structured_output import CompiledGrammar, GrammarCompiler, GrammarSpec\n"
        "print('script ran', flush=True)\n"
        "tok = tiny_tokenizer()\n"
        "compiler = GrammarCompiler(tok, stop_token_ids=[tok.eos_token_id])\n"
        "result = compiler.compile(GrammarSpec.regex('[0-9]+'))\n"
        "print(isinstance(result, CompiledGrammar), flush=True)\n"
        "compiler.close()\n"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.split() == ["script", "ran", "True"], done.stdout + done.stderr
