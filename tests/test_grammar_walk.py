"""Whatever tokens are sampled under the mask, a finished output validates against its schema.

Hypothesis draws JSON schemas (objects, arrays, enums, nested, required fields, bounded
numbers, strings with lengths and patterns, anyOf) and walks each grammar with random
allowed tokens of the real SmolLM2 tokenizer until it completes, then validates the decoded
text with jsonschema.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from backends.torch.loader import resolve_model
from backends.torch.sample.grammar_mask import allocate_bitmask
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarSpec,
    SequenceGrammar,
    check_spec,
)

pytestmark = pytest.mark.real_model

MAX_STEPS = 1000
NAMES = ["id", "name", "tags", "score", "ok", "kind", "items", "note"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("default"))


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> Iterator[GrammarCompiler]:
    grammar_compiler = GrammarCompiler(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    yield grammar_compiler
    grammar_compiler.close()


@pytest.fixture(scope="module")
def closers(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Whether each token closes something (a quote, brace or bracket): walks that often
    pick those finish within MAX_STEPS."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return np.array([any(c in (p or "") for c in '"}]') for p in pieces])


@st.composite
def integer_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    low = draw(st.none() | st.integers(-1000, 1000))
    if low is not None:
        schema["minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low or 0) + draw(st.integers(0, 500))
    return schema


@st.composite
def number_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    low = draw(st.none() | st.sampled_from([-10.5, -1, 0, 0.25, 3]))
    if low is not None:
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low or 0) + draw(st.sampled_from([0.5, 1, 7.75, 100]))
    return schema


@st.composite
def string_schema(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["plain", "length", "pattern"]))
    if kind == "pattern":
        pattern = draw(st.sampled_from(["^[a-z]{1,8}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"]))
        return {"type": "string", "pattern": pattern}
    if kind == "length":
        low = draw(st.integers(0, 3))
        return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(0, 8))}
    return {"type": "string"}


LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    integer_schema(),
    number_schema(),
    string_schema(),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.sampled_from([{"const": "fixed"}, {"enum": [1, 2.5, None, True]}]),
)


def containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def object_schema(draw: st.DrawFn) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        properties = {name: draw(children) for name in names}
        required = [n for n in names if draw(st.booleans())]
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            schema["required"] = required
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def array_schema(draw: st.DrawFn) -> dict[str, Any]:
        low = draw(st.integers(0, 2))
        schema = {"type": "array", "items": draw(children), "minItems": low}
        if draw(st.booleans()):
            schema["maxItems"] = low + draw(st.integers(0, 3))
        return schema

    any_of = st.lists(children, min_size=2, max_size=3).map(lambda c: {"anyOf": c})
    return st.one_of(object_schema(), array_schema(), any_of)


SCHEMAS = st.recursive(LEAVES, containers, max_leaves=8)


def random_walk(
    state: SequenceGrammar, rng: random.Random, closers: np.ndarray, eos: int
) -> list[int] | None:
    """Sample allowed tokens (closers 70% of the time, EOS when allowed half the time) until
    the grammar terminates; the tokens, or None past MAX_STEPS."""
    bitmask = allocate_bitmask(1, len(closers))
    for _ in range(MAX_STEPS):
        state.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: len(closers)]
        allowed = np.flatnonzero(bits)
        assert len(allowed), "the grammar allows no token"
        if eos in allowed and rng.random() < 0.5:
            token = eos
        else:
            closing = allowed[closers[allowed]]
            pool = closing if len(closing) and rng.random() < 0.7 else allowed
            token = int(pool[rng.randrange(len(pool))])
        assert state.accept(token), f"the grammar refused token {token} that its mask allowed"
        if state.is_terminated:
            return state.token_ids[:-1]  # without the EOS
    return None


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS, rng=st.randoms(use_true_random=False))
def test_every_finished_walk_validates_against_its_schema(
    schema: dict[str, Any],
    rng: random.Random,
    compiler: GrammarCompiler,
    tokenizer: PreTrainedTokenizerBase,
    closers: np.ndarray,
) -> None:
    spec = GrammarSpec.json_schema(schema)
    assert check_spec(spec) is None, check_spec(spec)
    grammar = compiler.compile(spec)
    assert isinstance(grammar, CompiledGrammar), grammar
    finished = 0
    for _ in range(3):
        tokens = random_walk(SequenceGrammar(grammar), rng, closers, tokenizer.eos_token_id)
        if tokens is None:  # a long array or string: not an output, nothing to validate
            continue
        finished += 1
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), schema)  # raises, naming the violation
    assert finished, f"no walk ended within {MAX_STEPS} tokens: {schema}"


def test_the_walk_would_catch_an_unconstrained_output(
    tokenizer: PreTrainedTokenizerBase, closers: np.ndarray
) -> None:
    """The oracle can fail: the same walk over `json_object`'s grammar yields outputs that an
    unrelated schema rejects."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar_compiler = GrammarCompiler(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    try:
        grammar = grammar_compiler.compile(GrammarSpec.json_object())
        assert isinstance(grammar, CompiledGrammar)
        rng = random.Random(0)
        texts = [
            tokenizer.decode(random_walk(SequenceGrammar(grammar), rng, closers, 2) or [])
            for _ in range(5)
        ]
        validator = jsonschema.Draft202012Validator(schema)
        assert not all(validator.is_valid(json.loads(t)) for t in texts)
    finally:
        grammar_compiler.close()
