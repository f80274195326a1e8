"""Grammar specs are checked before queueing: invalid or unenforceable ones are named."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from schedulers.structured_output import (
    GrammarErrorCode,
    GrammarKind,
    GrammarLimits,
    GrammarSpec,
    check_depth,
    check_spec,
)
from schedulers.structured_output.schema_support import MAX_JSON_DEPTH, json_schema_problem

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Address(BaseModel):
    street: str
    city: str = Field(max_length=40)


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    address: Address | None = None
    tags: list[str] = []


def code_of(spec: GrammarSpec, limits: GrammarLimits | None = None) -> GrammarErrorCode | None:
    error = check_spec(spec, limits)
    return None if error is None else error.code


def test_typical_schemas_pass_pydantic_models_included() -> None:
    for schema in (
        OBJECT,
        Person.model_json_schema(),
        {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        {"type": "string", "minLength": 2, "maxLength": 30},
        {"type": "integer", "multipleOf": 3},
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
        {"type": "object", "properties": {"p": {"$ref": "#"}}},
        True,
    ):
        assert check_spec(GrammarSpec.json_schema(schema)) is None, schema


def test_an_invalid_schema_is_refused_naming_where() -> None:
    error = check_spec(GrammarSpec.json_schema({"type": "object", "properties": {"a": 5}}))
    assert error is not None and error.code is GrammarErrorCode.INVALID
    assert "/properties/a" in error.message
    assert code_of(GrammarSpec.json_schema('{"type": ')) is GrammarErrorCode.INVALID
    assert code_of(GrammarSpec.json_schema(False)) is GrammarErrorCode.INVALID
    assert code_of(GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2]")) is GrammarErrorCode.INVALID


#: each refused feature, with a value that xgrammar's grammar accepts but the schema rejects:
#: the reason it is refused (the witness test below keeps this list honest)
UNENFORCED: list[tuple[str, dict[str, Any], str]] = [
    ("not", {"not": {"type": "string"}}, '"abc"'),
    (
        "if",
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": "x"}}, "required": ["a"]},
            "then": {"required": ["b"]},
        },
        '{"a": "x"}',
    ),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": "x"}',
    ),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]"),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        '{"a": "x"}',
    ),  # fmt: skip
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3"),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.2"),
    ("$ref", {"$defs": {"P": {"type": "integer"}}, "$ref": "#/$defs/P", "maximum": 3}, "5"),
    ("$ref", {"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, '"s"'),
    ("regex", {"type": "string", "pattern": "^(?=a)[a-z]+$"}, '"b"'),
    ("maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"'),
    ("maxLength", {"type": "string", "format": "date", "minLength": 20}, '"2020-01-01"'),
]


@pytest.mark.parametrize(("feature", "schema", "leak"), UNENFORCED)
def test_features_the_grammar_does_not_enforce_are_refused_by_name(
    feature: str, schema: dict[str, Any], leak: str
) -> None:
    error = check_spec(GrammarSpec.json_schema(schema))
    assert error is not None and error.code is GrammarErrorCode.UNSUPPORTED
    assert feature in error.message


@pytest.mark.parametrize(("feature", "schema", "leak"), UNENFORCED)
def test_each_refused_feature_really_leaks_through_xgrammar(
    feature: str, schema: dict[str, Any], leak: str
) -> None:
    """The witness: xgrammar accepts `leak`, which the schema rejects. When a new xgrammar
    enforces a feature, this fails, and the refusal can be lifted."""
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    assert _is_grammar_accept_string(grammar, leak)
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(leak))


def test_remote_refs_are_refused_and_never_fetched() -> None:
    error = check_spec(GrammarSpec.json_schema({"$ref": "http://169.254.169.254/schema.json"}))
    assert error is not None and error.code is GrammarErrorCode.UNSUPPORTED
    assert "local" in error.message


def test_an_unknown_dollar_schema_is_refused_before_anything_could_fetch_it() -> None:
    for schema in (
        {"$schema": "http://127.0.0.1:1/meta.json", "type": "string"},
        {"type": "object", "properties": {"a": {"$schema": "https://x.invalid/s"}}},
    ):
        error = check_spec(GrammarSpec.json_schema(schema))
        assert error is not None and "Unknown '$schema'" in error.message
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}
    assert check_spec(GrammarSpec.json_schema(draft7)) is None


def test_oneof_with_provably_disjoint_branches_passes() -> None:
    by_type = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    by_const = {
        "oneOf": [
            {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
            {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]},
        ]
    }
    by_ref = {
        "$defs": {"A": by_const["oneOf"][0], "B": by_const["oneOf"][1]},
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
    }
    for schema in (by_type, by_const, by_ref):
        assert check_spec(GrammarSpec.json_schema(schema)) is None, schema
    overlapping = {"oneOf": [{"type": "object"}, {"type": "object", "required": ["k"]}]}
    assert code_of(GrammarSpec.json_schema(overlapping)) is GrammarErrorCode.UNSUPPORTED


def test_refused_features_are_found_however_deep_they_are() -> None:
    schema = {
        "type": "object",
        "$defs": {"inner": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "properties": {"outer": {"anyOf": [{"$ref": "#/$defs/inner"}, {"type": "null"}]}},
    }
    error = check_spec(GrammarSpec.json_schema(schema))
    assert error is not None and "/$defs/inner" in error.message


def test_size_and_depth_limits() -> None:
    big = {"enum": [f"value_{i}" for i in range(5000)]}
    limits = GrammarLimits(max_spec_bytes=1000)
    assert code_of(GrammarSpec.json_schema(big), limits) is GrammarErrorCode.TOO_LARGE
    assert code_of(GrammarSpec.json_schema(big)) is None
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    assert code_of(GrammarSpec.json_schema(deep)) is GrammarErrorCode.TOO_DEEP


def test_any_depth_is_measured_without_recursion_and_refused_before_anything_recurses() -> None:
    far_too_deep: dict[str, Any] = {"type": "string"}
    for _ in range(100_000):  # no recursive walk (copy, json.dumps, jsonschema) survives this
        far_too_deep = {"type": "array", "items": far_too_deep}
    error = check_depth(far_too_deep)
    assert error is not None and error.code is GrammarErrorCode.TOO_DEEP
    assert f"{MAX_JSON_DEPTH} levels" in error.message
    text = '{"const":' + "[" * 400 + "]" * 400 + "}"  # deep enough to overflow a deepcopy
    spec = GrammarSpec.json_schema(text)
    assert spec.normalized.startswith("json_schema:")  # refused below, never a RecursionError
    assert code_of(spec) is GrammarErrorCode.TOO_DEEP
    too_deep_to_parse = GrammarSpec.json_schema("[" * 40_000 + "]" * 40_000)
    assert code_of(too_deep_to_parse) is GrammarErrorCode.TOO_DEEP
    at_the_limit = '{"const":' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    assert check_spec(GrammarSpec.json_schema(at_the_limit)) is None


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"anyOf": [{"$ref": "#"}]}, "/"),
        ({"allOf": [{"$ref": "#"}]}, "/"),
        ({"anyOf": [{"$ref": "#"}, False]}, "/"),
        ({"properties": {"a": {"anyOf": [{"$ref": "#/properties/a"}]}}}, "/properties/a"),
        ({"$defs": {"a": {"oneOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
          "type": "array", "items": {"$ref": "#/$defs/a"}}, "/items"),
    ],
)  # fmt: skip
def test_a_cycle_of_aliases_with_no_way_out_is_refused_naming_where(
    schema: dict[str, Any], pointer: str
) -> None:
    problem = json_schema_problem(schema)
    assert problem is not None and problem[0] == "invalid", problem
    assert f"at {pointer}" in problem[1], problem


@pytest.mark.parametrize(
    "schema",
    [
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        {"anyOf": [{"$ref": "#"}, True]},
        {"type": "object", "properties": {"next": {"$ref": "#"}}},
        {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "string"}]},
                   "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(500)}
         | {"d500": {"type": "string"}}, "$ref": "#/$defs/d0"},
    ],
)  # fmt: skip
def test_cycles_with_a_way_out_and_long_ref_chains_pass(schema: dict[str, Any]) -> None:
    assert json_schema_problem(schema) is None


def test_equal_schemas_written_differently_are_one_spec() -> None:
    compact = GrammarSpec.json_schema(OBJECT)
    spaced = GrammarSpec.json_schema(json.dumps(OBJECT, indent=4))
    assert compact == spaced and hash(compact) == hash(spaced)
    assert GrammarSpec.json_schema({"b": 1, "a": 2}) != GrammarSpec.json_schema({"a": 2, "b": 1})


def test_regex_choice_grammar_and_structural_tag_checks() -> None:
    assert check_spec(GrammarSpec.regex(r"^\d{3}-(yes|no)$")) is None
    for pattern in (r"(?=a)b", r"(a)\1", r"\bword", r"(?i)abc", r"\p{L}+", ""):
        assert check_spec(GrammarSpec.regex(pattern)) is not None, pattern
    assert check_spec(GrammarSpec.regex(r"[(?=]x")) is None  # inside a class: literals
    assert check_spec(GrammarSpec.choice(["red", "green"])) is None
    assert code_of(GrammarSpec.choice([])) is GrammarErrorCode.INVALID
    assert code_of(GrammarSpec.choice(["", "x"])) is GrammarErrorCode.INVALID
    assert code_of(GrammarSpec.grammar("  ")) is GrammarErrorCode.INVALID
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<x>",
            "content": {"type": "json_schema", "json_schema": {"not": {}}},
            "end": "</x>",
        },
    }
    error = check_spec(GrammarSpec.structural_tag(tag))
    assert error is not None and "format.content.json_schema" in error.message
    assert code_of(GrammarSpec.structural_tag({"type": "tag"})) is GrammarErrorCode.INVALID


def test_importing_the_specs_and_the_gateway_helpers_imports_neither_xgrammar_nor_torch() -> None:
    code = (
        "import sys, schedulers.structured_output as s\n"
        "import gateway.api.outputs.tools, gateway.api.outputs.tool_parser\n"
        "import gateway.api.outputs.response_format\n"
        "import gateway.api.responses.protocol, gateway.api.responses.convert\n"
        "import gateway.api.responses.events, gateway.api.responses.store\n"
        "s.check_spec(s.GrammarSpec.json_schema({'type': 'object'}))\n"
        "sys.exit(int('torch' in sys.modules or 'xgrammar' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
