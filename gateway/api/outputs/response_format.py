"""The output constraint a request asks for, as a `GrammarSpec` (or a problem naming its param).

Three spellings reach the same specs:
- Chat Completions / Completions `response_format`: `{"type": "text"}`, `{"type":
  "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`,
  and xgrammar's `{"type": "structural_tag", "format": {...}}` (as vLLM accepts it);
- vLLM's `structured_outputs` body field: exactly one of `json` (a schema, or its JSON
  text), `regex`, `choice`, `grammar` (EBNF), `json_object: true`, `structural_tag`;
- the Responses API's `text.format`: `{"type": "text" | "json_object" | "json_schema",
  "name", "schema", "strict"}`.
Each helper only parses the shape, and refuses a schema nested over `MAX_JSON_DEPTH` levels
(`check_depth`, which never recurses) before anything that does; `check_spec` (run by the
compiler, or directly) judges the schema itself. `strict` is accepted either way: Carousel
always decodes in strict mode and refuses what it cannot enforce
(docs/structured-outputs.md).
Pure Python: no torch, no xgrammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.api.problems import ParamProblem
from schedulers.structured_output import GrammarErrorCode, GrammarKind, GrammarSpec, check_depth

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

GrammarResult = GrammarSpec | None | ParamProblem


def grammar_for_response_format(
    response_format: Any, param: str = "response_format"
) -> GrammarResult:
    """Chat Completions `response_format` -> spec (None for text or absent)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        return ParamProblem(param, "'response_format' must be an object.")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping):
            return ParamProblem(
                f"{param}.json_schema", "Missing required parameter: 'json_schema'."
            )
        return _json_schema(body, f"{param}.json_schema")
    if kind == "structural_tag" and "format" in response_format:
        return _structural_tag(response_format, param)
    return ParamProblem(
        f"{param}.type",
        f"Invalid response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'.",
    )


def grammar_for_text_format(text: Any, param: str = "text") -> GrammarResult:
    """Responses API `text` (`{"format": {...}}`) -> spec (None for text or absent)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        return ParamProblem(param, "'text' must be an object.")
    fmt = text.get("format")
    if fmt is None:
        return None
    where = f"{param}.format"
    if not isinstance(fmt, Mapping):
        return ParamProblem(where, "'text.format' must be an object.")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        return _json_schema(fmt, where)
    return ParamProblem(
        f"{where}.type",
        f"Invalid text.format type {kind!r}: expected 'text', 'json_object' or 'json_schema'.",
    )


def grammar_for_structured_outputs(
    structured_outputs: Any, param: str = "structured_outputs"
) -> GrammarResult:
    """vLLM's `structured_outputs` field -> spec (None when absent or empty)."""
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, Mapping):
        return ParamProblem(param, "'structured_outputs' must be an object.")
    present = [
        key for key in STRUCTURED_OUTPUT_KEYS if structured_outputs.get(key) not in (None, False)
    ]
    if not present:
        return None
    if len(present) > 1:
        return ParamProblem(
            param, f"Set only one of {', '.join(STRUCTURED_OUTPUT_KEYS)}; got {', '.join(present)}."
        )
    key = present[0]
    value = structured_outputs[key]
    where = f"{param}.{key}"
    if key == "json":
        value = _loads(value, where, key) if isinstance(value, str) else value
        if isinstance(value, ParamProblem):
            return value
        if not isinstance(value, Mapping | bool):
            return ParamProblem(where, "'json' must be a JSON schema.")
        return _too_deep(value, where) or GrammarSpec.json_schema(
            value if isinstance(value, bool) else dict(value)
        )
    if key == "json_object":
        return GrammarSpec.json_object()
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return ParamProblem(where, "'choice' must be a list of strings.")
        return GrammarSpec.choice(value)
    if key == "structural_tag":
        tag = _loads(value, where, key) if isinstance(value, str) else value
        if isinstance(tag, ParamProblem):
            return tag
        if not isinstance(tag, Mapping):
            return ParamProblem(where, "'structural_tag' must be an object.")
        return _structural_tag(tag, where)
    if not isinstance(value, str):
        return ParamProblem(where, f"'{key}' must be a string.")
    return GrammarSpec.regex(value) if key == "regex" else GrammarSpec.grammar(value)


def _json_schema(body: Mapping[str, Any], where: str) -> GrammarResult:
    """`{"name", "schema", "strict", "description"}` (OpenAI's json_schema object)."""
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        return ParamProblem(
            f"{where}.name",
            f"Invalid 'name' {name!r}: it must be 1-64 characters of a-z, A-Z, 0-9, "
            "underscores and dashes.",
        )
    schema = body.get("schema")
    if schema is None:
        return GrammarSpec.json_object()
    if not isinstance(schema, Mapping):
        return ParamProblem(f"{where}.schema", "'schema' must be a JSON schema object.")
    return _too_deep(schema, f"{where}.schema") or GrammarSpec.json_schema(dict(schema))


def _structural_tag(tag: Mapping[str, Any], where: str) -> GrammarResult:
    return _too_deep(tag, where, GrammarKind.STRUCTURAL_TAG) or GrammarSpec.structural_tag(
        dict(tag)
    )


def _too_deep(
    value: Any, where: str, kind: GrammarKind = GrammarKind.JSON_SCHEMA
) -> ParamProblem | None:
    """A 400 naming `where` when `value` nests too deeply for the checks and the compiler."""
    error = check_depth(value, kind)
    return None if error is None else ParamProblem(where, error.message, str(error.code))


def _loads(text: str, where: str, key: str) -> Any:
    """The JSON value of a string field, or a problem naming it (a depth no parser takes
    included)."""
    try:
        return json.loads(text)
    except RecursionError:
        return ParamProblem(where, f"'{key}' is nested too deeply.", str(GrammarErrorCode.TOO_DEEP))
    except ValueError as exc:
        return ParamProblem(where, f"'{key}' is not valid JSON: {exc}")
