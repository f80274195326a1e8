"""Property: whatever JSON schema a client sends (objects, arrays, enums, nesting, required
fields, bounded numbers and strings), the default model's output under its grammar, through
the whole engine at temperature 1 over several seeds, parses and validates with jsonschema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from backends.torch.runner.backend import TorchBackend
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from schedulers.structured_output import CompiledGrammar, GrammarSpec

pytestmark = pytest.mark.real_model

SEEDS = 3
MAX_TOKENS = 160
NAMES = ["id", "name", "a", "b2", "x_y", "kind", "n"]

integers = st.builds(
    lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
    st.integers(-50, 50),
    st.integers(0, 200),
)
numbers = st.builds(
    lambda low, span, exclusive: (
        {"type": "number", "exclusiveMinimum": low, "maximum": low + span}
        if exclusive
        else {"type": "number", "minimum": low, "maximum": low + span}
    ),
    st.integers(-10, 10),
    st.integers(1, 20),
    st.booleans(),
)
strings = st.builds(
    lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra},
    st.integers(0, 3),
    st.integers(0, 6),
)
enums = st.lists(
    st.one_of(st.text("abcxyz", min_size=1, max_size=5), st.integers(-9, 99)),
    min_size=1,
    max_size=4,
    unique=True,
).map(lambda values: {"enum": values})
leaves = st.one_of(integers, numbers, strings, enums, st.just({"type": "boolean"}))


@st.composite
def objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    properties = {name: draw(children) for name in names}
    required = [name for name in names if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required}


@st.composite
def arrays(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    most = draw(st.integers(0, 3))
    return {
        "type": "array",
        "items": draw(children),
        "minItems": draw(st.integers(0, most)),
        "maxItems": most,
    }


schemas = st.recursive(
    leaves, lambda children: st.one_of(objects(children), arrays(children)), max_leaves=5
)
#: what a client's response_format carries: an object at the top
top_level = objects(schemas)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    backend = TorchBackend.load("default", device="cpu", kv_cache_gb=0.25, max_model_len=512)
    with LLM(backend, "orca", SchedulerConfig(max_num_seqs=8)) as engine_llm:
        yield engine_llm


def prompt(llm: LLM, schema: dict[str, Any]) -> list[int]:
    tokenizer = llm.engine.backend.tokenizer
    question = f"Reply with a JSON object with the keys {', '.join(schema['properties'])}."
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered)


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example costs seconds
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=top_level)
def test_every_output_validates_against_a_generated_schema(
    llm: LLM, schema: dict[str, Any]
) -> None:
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    grammar = compiler.submit(GrammarSpec.json_schema(schema)).result(timeout=60)
    assert isinstance(grammar, CompiledGrammar), grammar  # every generated feature is enforced
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=len(json.dumps(schema)), n=SEEDS,
        grammar=grammar,
    )  # fmt: skip
    (gen,) = llm.generate([prompt(llm, schema)], params)
    for choice in gen.choices:
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.error, choice.text)
        assert choice.token_ids[-1] in llm.engine.backend.eos_token_ids
        jsonschema.validate(json.loads(choice.text), schema)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
