"""response_format, vLLM's structured_outputs and Responses text.format -> one GrammarSpec."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from gateway.api.outputs.response_format import (
    grammar_for_response_format,
    grammar_for_structured_outputs,
    grammar_for_text_format,
)
from gateway.api.problems import ParamProblem
from schedulers.structured_output import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Answer(BaseModel):
    a: int


def test_chat_response_formats() -> None:
    assert grammar_for_response_format(None) is None
    assert grammar_for_response_format({"type": "text"}) is None
    assert grammar_for_response_format({"type": "json_object"}) == GrammarSpec.json_object()
    body = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": SCHEMA}}
    assert grammar_for_response_format(body) == GrammarSpec.json_schema(SCHEMA)
    strict = {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}
    assert grammar_for_response_format(strict) == GrammarSpec.json_schema(SCHEMA)
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert grammar_for_response_format(tag) == GrammarSpec.structural_tag(tag)


def test_the_sdks_parse_helper_body_is_understood() -> None:
    """`client.chat.completions.parse(response_format=Answer)` sends this shape."""
    from openai.lib._pydantic import to_strict_json_schema

    schema = to_strict_json_schema(Answer)
    body = {
        "type": "json_schema",
        "json_schema": {"name": "Answer", "schema": schema, "strict": True},
    }
    assert grammar_for_response_format(body) == GrammarSpec.json_schema(schema)


NAMELESS = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
NOT_A_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (NAMELESS, "response_format.json_schema.name"),
        (NOT_A_SCHEMA, "response_format.json_schema.schema"),
        ("json", "response_format"),
    ],
)
def test_bad_response_formats_name_their_param(response_format: Any, param: str) -> None:
    result = grammar_for_response_format(response_format)
    assert isinstance(result, ParamProblem) and result.param == param


def test_vllm_structured_outputs() -> None:
    assert grammar_for_structured_outputs({"json": SCHEMA}) == GrammarSpec.json_schema(SCHEMA)
    assert grammar_for_structured_outputs({"json": '{"type": "integer"}'}) == (
        GrammarSpec.json_schema({"type": "integer"})
    )
    assert grammar_for_structured_outputs({"regex": "[0-9]+"}) == GrammarSpec.regex("[0-9]+")
    assert grammar_for_structured_outputs({"choice": ["a", "b"]}) == GrammarSpec.choice(["a", "b"])
    assert grammar_for_structured_outputs({"grammar": 'root ::= "x"'}) == (
        GrammarSpec.grammar('root ::= "x"')
    )
    assert grammar_for_structured_outputs({"json_object": True}) == GrammarSpec.json_object()
    assert grammar_for_structured_outputs({}) is None
    assert grammar_for_structured_outputs({"json_object": False, "regex": None}) is None
    two = grammar_for_structured_outputs({"regex": "a", "choice": ["a"]})
    assert isinstance(two, ParamProblem) and two.param == "structured_outputs"
    bad = grammar_for_structured_outputs({"choice": "a"})
    assert isinstance(bad, ParamProblem) and bad.param == "structured_outputs.choice"
    bad_json = grammar_for_structured_outputs({"json": "{"})
    assert isinstance(bad_json, ParamProblem) and bad_json.param == "structured_outputs.json"


def test_responses_text_format() -> None:
    assert grammar_for_text_format(None) is None
    assert grammar_for_text_format({"format": {"type": "text"}}) is None
    assert grammar_for_text_format({"format": {"type": "json_object"}}) == GrammarSpec.json_object()
    fmt = {"type": "json_schema", "name": "Answer", "schema": SCHEMA, "strict": True}
    assert grammar_for_text_format({"format": fmt}) == GrammarSpec.json_schema(SCHEMA)
    bad = grammar_for_text_format({"format": {"type": "json_schema", "schema": SCHEMA}})
    assert isinstance(bad, ParamProblem) and bad.param == "text.format.name"
    other = grammar_for_text_format({"format": {"type": "grammar"}})
    assert isinstance(other, ParamProblem) and other.param == "text.format.type"
