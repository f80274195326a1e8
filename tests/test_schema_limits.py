"""Every schema the server cannot take is a 400 naming why, never a 500 or a hang
(docs/structured-outputs.md, "Limits"), against a live server over a tiny random torch model
(byte tokenizer, real xgrammar compiler, a 1 s compile deadline).

Schemas are written as JSON text, never as nested dicts: a client's `json.dumps` would itself
overflow on the deepest ones. The fuzz draws shapes by their nesting (through `items`,
`properties`, `anyOf`, `allOf`, `prefixItems`), `$ref` chains through `$defs`, and cycles
(a `$ref` to the root, a cycle with or without a way out).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import torch
import xgrammar
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import TINY, tiny_tokenizer
from gateway.arms.local import LocalArm
from schedulers.base import SchedulerConfig
from schedulers.structured_output.schema_support import MAX_JSON_DEPTH
from tests.conftest import SIM_MODEL, LiveServer, error_of, start_server
from tests.test_structured_tiny import TEMPLATE

COMPILE_DEADLINE_S = 1.0
#: `@` stands for the schema each wrapper nests one level deeper
WRAPPERS = {
    "items": '{"type":"array","items":@}',
    "properties": '{"type":"object","properties":{"a":@},"required":["a"]}',
    "anyOf": '{"anyOf":[@,{"type":"null"}]}',
    "allOf": '{"allOf":[@]}',
    "prefixItems": '{"type":"array","prefixItems":[@]}',
    "cycle": '{"anyOf":[@,{"$ref":"#"}]}',  # a cycle with a way out
}
LEAVES = [
    '{"type":"string"}',
    '{"type":"integer","minimum":0}',
    '{"enum":["a","b"]}',
    "{}",
    "true",
    "false",
    '{"$ref":"#"}',  # back to the root: a cycle
    '{"anyOf":[{"$ref":"#"}]}',  # a cycle with no way out
    '{"$ref":"#/$defs/d0"}',  # into the chain, or dangling
]
#: 2 MiB compiled in ~50 ms, but xgrammar's serialisation of it is ~250 MB (~10 s)
UNION_OF_OBJECTS = (
    '{"anyOf":['
    + ",".join(
        '{"type":"object","properties":{'
        + ",".join(f'"k{i}_{j}":{{"type":"string","maxLength":40}}' for j in range(10))
        + f'}},"required":["k{i}_0","k{i}_1","k{i}_2"]}}'
        for i in range(50)
    )
    + "]}"
)


@pytest.fixture(scope="module")
def tiny() -> Iterator[LiveServer]:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**TINY, "max_position_embeddings": 2048}, eos_token_id=tokenizer.eos_token_id
    )
    backend = TorchBackend(
        LlamaForCausalLM(config), tokenizer, device="cpu", kv_cache_gb=0.05, block_size=16
    )
    scheduling = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=4096, grammar_compile_timeout_s=COMPILE_DEADLINE_S
    )
    with ExitStack() as stack:
        yield start_server(stack, LocalArm.from_backend(backend, config=scheduling))


def nested(key: str, levels: int, leaf: str = '{"type":"string"}') -> str:
    """`leaf` wrapped `levels` times by WRAPPERS[key], as JSON text."""
    head, tail = WRAPPERS[key].split("@")
    return head * levels + leaf + tail * levels


def body_with(schema: str, where: str = "response_format") -> str:
    """A chat body (JSON text) whose `where` holds `schema`."""
    head = '{"model":"' + SIM_MODEL + '","max_tokens":4,"messages":[{"role":"user","content":"x"}]'
    if where == "response_format":
        json_schema = f'{{"name":"s","schema":{schema}}}'
        field = f'"response_format":{{"type":"json_schema","json_schema":{json_schema}}}'
    elif where == "structured_outputs":
        field = f'"structured_outputs":{{"json":{schema}}}'
    else:
        field = (
            f'"tools":[{{"type":"function","function":{{"name":"f","parameters":{schema}}}}}],'
            '"tool_choice":"required"'
        )
    return f"{head},{field}}}"


def post(server: LiveServer, body: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.v1}/chat/completions", content=body, headers=headers, timeout=60)


def refusal(response: httpx.Response) -> dict[str, Any]:
    """The 400's OpenAI error object (shape asserted)."""
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


@pytest.mark.parametrize(
    ("key", "levels"), [("items", 500), ("properties", 200), ("anyOf", 200), ("allOf", 300)]
)
def test_a_schema_nested_past_the_json_depth_is_a_400_naming_it(
    tiny: LiveServer, key: str, levels: int
) -> None:
    error = refusal(post(tiny, body_with(nested(key, levels))))
    assert error["param"] == "response_format.json_schema.schema", error
    assert error["code"] == "grammar_too_deep", error
    assert f"{MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize(
    ("where", "param"),
    [("structured_outputs", "structured_outputs.json"), ("tools", "tools[0].function.parameters")],
)
def test_other_schema_fields_nested_500_levels_are_400s_naming_them(
    tiny: LiveServer, where: str, param: str
) -> None:
    error = refusal(post(tiny, body_with(nested("items", 500), where)))
    assert (error["param"], error["code"]) == (param, "grammar_too_deep"), error


def test_a_schema_string_too_deep_for_any_parser_is_a_400(tiny: LiveServer) -> None:
    text = nested("allOf", 20_000).replace('"', '\\"')
    body = body_with(f'"{text}"', "structured_outputs")
    error = refusal(post(tiny, body))
    assert (error["param"], error["code"]) == ("structured_outputs.json", "grammar_too_deep")


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_at_the_depth_limit_is_served(tiny: LiveServer, where: str) -> None:
    levels = MAX_JSON_DEPTH - 1  # the schema object is the first level
    schema = '{"const":' + "[" * levels + "]" * levels + "}"
    response = post(tiny, body_with(schema, where))
    assert response.status_code == 200, response.text


def test_subschemas_nested_past_their_depth_are_refused_by_the_check(tiny: LiveServer) -> None:
    error = refusal(post(tiny, body_with(nested("items", 100))))  # 101 levels of JSON: checked
    assert error["code"] == "grammar_too_deep" and "64 levels" in error["message"], error


def test_a_schema_that_matches_nothing_is_a_400_not_an_engine_error(tiny: LiveServer) -> None:
    looping = '{"type":"object","properties":{"a":{"anyOf":[{"$ref":"#/properties/a"}]}}}'
    error = refusal(post(tiny, body_with(looping)))
    assert error["code"] == "invalid_grammar" and "/properties/a" in error["message"], error


def test_a_grammar_too_big_to_hand_back_is_a_400_at_the_deadline_and_never_compiled_here(
    tiny: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_compiling_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the gateway process compiled a grammar")

    monkeypatch.setattr(xgrammar, "GrammarCompiler", no_compiling_here)  # the children's own
    start = time.monotonic()
    error = refusal(post(tiny, body_with(UNION_OF_OBJECTS)))
    assert time.monotonic() - start < COMPILE_DEADLINE_S + 3
    assert error["param"] == "response_format.json_schema.schema", error
    assert error["code"] == "grammar_too_large" and "hand back" in error["message"], error


@st.composite
def schema_texts(draw: st.DrawFn) -> str:
    """A schema as JSON text: a leaf nested by a few runs of wrappers and `$ref` hops."""
    text = draw(st.sampled_from(LEAVES))
    defs: list[str] = []
    levels = st.integers(1, 8) | st.integers(1, 600)  # mostly shallow, sometimes far too deep
    runs = draw(st.lists(st.tuples(st.sampled_from([*WRAPPERS, "ref"]), levels)))
    for key, levels in runs[:3]:
        if key != "ref":
            text = nested(key, levels, text)
            continue
        for _ in range(min(levels, 40)):  # a chain d0 -> d1 -> ... -> the schema so far
            defs.append(text)
            text = f'{{"$ref":"#/$defs/d{len(defs) - 1}"}}'
    if not defs:
        return text
    named = ",".join(f'"d{len(defs) - 1 - i}":{d}' for i, d in enumerate(defs))
    return f'{{"$defs":{{{named}}},"allOf":[{text}]}}'


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    schema=schema_texts(),
    where=st.sampled_from(["response_format", "structured_outputs", "tools"]),
)
def test_any_schema_shape_is_answered_200_or_400_never_500(
    tiny: LiveServer, schema: str, where: str
) -> None:
    response = post(tiny, body_with(schema, where))  # NOTE: a hang fails on httpx's timeout
    event(f"{response.status_code} {response.json().get('error', {}).get('code')}")
    if response.status_code == 200:
        assert response.json()["choices"], response.text
        return
    error = refusal(response)
    if error["code"] == "context_length_exceeded":  # the tools are shown in the prompt
        return
    if error["param"] is not None:  # None: the body itself nests too deeply to parse
        assert error["param"].startswith(where), error
