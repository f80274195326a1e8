"""What a request asks its output to match (`GrammarSpec`), and the checks made before queueing.

No xgrammar and no torch here (json and jsonschema-rs only), so the gateway can validate a
request's grammar before it queues anything. Compiling is `compiler.py`'s job.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schedulers.structured_output.schema_support import (
    MAX_JSON_DEPTH,
    json_schema_problem,
    nested_deeper_than,
    regex_problem,
    without_annotations,
)

#: most options a `choice` may list
MAX_CHOICES = 1024
#: levels a structural tag may add above the schemas in it (the call format takes 7: tag,
#: format, elements, element, tags, tag, content), so a tool's `parameters` at the depth
#: limit still fit in the grammar of the calls
TAG_DEPTH_ALLOWANCE = 16


class GrammarKind(enum.StrEnum):
    """The kinds of constraint a request can ask for; each says what `GrammarSpec.text` holds."""

    JSON_SCHEMA = "json_schema"  # the schema, as compact JSON
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's json_object mode); text unused
    REGEX = "regex"  # the pattern; the whole output must match it
    CHOICE = "choice"  # a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF, as llama.cpp and xgrammar read it)
    STRUCTURAL_TAG = "structural_tag"  # an xgrammar structural tag, as JSON (tool calls)


class GrammarErrorCode(enum.StrEnum):
    """Why a grammar was refused (the gateway maps each to a 400, or 503 for `BUSY`)."""

    INVALID = "invalid_grammar"  # not valid JSON / not a valid JSON schema / malformed spec
    UNSUPPORTED = "unsupported_grammar_feature"  # valid, but the grammar cannot enforce it
    TOO_LARGE = "grammar_too_large"  # over a size limit (text, compiled grammar, hand-back)
    TOO_DEEP = "grammar_too_deep"  # nested deeper than the JSON or subschema depth limit
    TIMEOUT = "grammar_compile_timeout"  # compiling ran past the time limit
    COMPILE = "grammar_compile_error"  # xgrammar refused it while compiling
    BUSY = "grammar_compiler_busy"  # too many compiles in flight; retry later


_PROBLEM_CODES = {
    "invalid": GrammarErrorCode.INVALID,
    "unsupported": GrammarErrorCode.UNSUPPORTED,
    "too_large": GrammarErrorCode.TOO_LARGE,
    "too_deep": GrammarErrorCode.TOO_DEEP,
}


@dataclass(frozen=True)
class GrammarError:
    """A grammar that cannot be served, as a value: `code` says why, `message` says what.

    The caller knows where the grammar came from and names the request `param`.
    """

    code: GrammarErrorCode
    message: str


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar's cost, checked before and while it compiles."""

    max_spec_bytes: int = 100_000  # the text of the schema / regex / grammar / tag
    compile_timeout_s: float = 10.0  # wall time of one compile, from when a worker starts it
    max_grammar_bytes: int = 64 << 20  # the compiled grammar's memory
    #: the compiled grammar as xgrammar serialises it (10-100x its memory), which is how it
    #: leaves the compile process; the gateway rebuilds it at ~60 MB/s (~0.5 s at the limit)
    max_handback_bytes: int = 32 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint; equal specs share one compiled grammar (it is the cache key).

    Build them with the classmethods, which canonicalize the text (compact JSON) so equal
    schemas written differently share a cache entry. JSON schemas are always decoded in
    xgrammar's strict mode: only declared properties are generated (unless the schema gives
    `additionalProperties` a schema), which keeps outputs valid and small models finishing.
    """

    kind: GrammarKind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> GrammarSpec:
        """A JSON schema, given as a dict, `true`/`false`, or its JSON text."""
        return cls(GrammarKind.JSON_SCHEMA, _canonical_json(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> GrammarSpec:
        return cls(GrammarKind.GRAMMAR, ebnf)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any] | str) -> GrammarSpec:
        """An xgrammar structural tag (`{"type": "structural_tag", "format": {...}}`)."""
        return cls(GrammarKind.STRUCTURAL_TAG, _canonical_json(tag))

    @functools.cached_property
    def normalized(self) -> str:
        """The spec's normalised form: what it constrains, whatever its spelling. JSON kinds
        as canonical JSON (keys sorted) without annotations (`description`, `title`, ...),
        other kinds as their text. The compiler remembers failures under it, so varying a
        failed schema's key order or descriptions does not compile it again.

        NOTE: not the cache key of compiled grammars: key order is the order properties are
        generated in.
        """
        if self.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG):
            return f"{self.kind}:{self.text}"
        try:
            value = json.loads(self.text)
        except (ValueError, RecursionError):
            return f"{self.kind}:{self.text}"
        if check_depth(value, self.kind) is not None:  # refused by check_spec: kept as is
            return f"{self.kind}:{self.text}"
        if self.kind is GrammarKind.JSON_SCHEMA:
            value = without_annotations(value)
        else:
            for _, schema in _tag_schemas(
                value.get("format") if isinstance(value, dict) else None, ""
            ):
                without_annotations(schema, copy=False)
        return f"{self.kind}:{json.dumps(value, sort_keys=True, separators=(',', ':'))}"

    def choices(self) -> list[str]:
        """The options of a CHOICE spec."""
        options = json.loads(self.text)
        assert isinstance(options, list)
        return [str(option) for option in options]


def check_spec(spec: GrammarSpec, limits: GrammarLimits | None = None) -> GrammarError | None:
    """What is wrong with `spec` before compiling it, or None when it may be compiled.

    Checks the size limit, that JSON parses and nests at most `MAX_JSON_DEPTH` levels deep
    (before anything that recurses), that a JSON schema is valid against its
    meta-schema and uses only what the grammar enforces (also the schemas inside a
    structural tag), that choices are a non-empty list of strings, and that a regex avoids
    what xgrammar does not implement. xgrammar itself may still refuse a grammar while
    compiling (`GrammarErrorCode.COMPILE`).
    """
    limits = limits or GrammarLimits()
    size = len(spec.text.encode())
    if size > limits.max_spec_bytes:
        return GrammarError(
            GrammarErrorCode.TOO_LARGE,
            f"The {spec.kind} is {size} bytes; the limit is {limits.max_spec_bytes} bytes.",
        )
    if spec.kind is GrammarKind.JSON_OBJECT:
        return None
    if spec.kind is GrammarKind.REGEX:
        return _regex_error(spec.text)
    if spec.kind is GrammarKind.GRAMMAR:
        if not spec.text.strip():
            return GrammarError(GrammarErrorCode.INVALID, "The grammar is empty.")
        return None
    try:
        value = json.loads(spec.text)
    except ValueError as exc:
        return GrammarError(GrammarErrorCode.INVALID, f"The {spec.kind} is not valid JSON: {exc}")
    except RecursionError:
        return _too_deep(spec.kind)
    deep = check_depth(value, spec.kind)  # NOTE: first: the checks below recurse
    if deep is not None:
        return deep
    if spec.kind is GrammarKind.CHOICE:
        return _choice_error(value)
    if spec.kind is GrammarKind.JSON_SCHEMA:
        return _schema_error(value, "")
    return _structural_tag_error(value)


def check_depth(value: Any, kind: GrammarKind = GrammarKind.JSON_SCHEMA) -> GrammarError | None:
    """`TOO_DEEP` when JSON `value` nests objects and arrays over `MAX_JSON_DEPTH` levels
    (a structural tag: `TAG_DEPTH_ALLOWANCE` more). It never recurses: call it on a
    request's schema before anything that does (copies, `json.dumps`, the checks, xgrammar)."""
    return _too_deep(kind) if nested_deeper_than(value, _depth_limit(kind)) else None


def _depth_limit(kind: GrammarKind) -> int:
    extra = TAG_DEPTH_ALLOWANCE if kind is GrammarKind.STRUCTURAL_TAG else 0
    return MAX_JSON_DEPTH + extra


def _too_deep(kind: GrammarKind) -> GrammarError:
    return GrammarError(
        GrammarErrorCode.TOO_DEEP,
        f"The {kind} nests objects and arrays over {_depth_limit(kind)} levels deep.",
    )


def _canonical_json(value: Mapping[str, Any] | bool | str) -> str:
    """Compact JSON text of `value` (a JSON text is re-dumped; one that does not parse is kept
    as is, for `check_spec` to refuse)."""
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return value
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))


def _schema_error(schema: Any, where: str) -> GrammarError | None:
    problem = json_schema_problem(schema)
    if problem is None:
        return None
    kind, message = problem
    return GrammarError(_PROBLEM_CODES[kind], f"{where}{message}")


def _regex_error(pattern: str) -> GrammarError | None:
    if not pattern:
        return GrammarError(GrammarErrorCode.INVALID, "The regex is empty.")
    problem = regex_problem(pattern)
    return None if problem is None else GrammarError(GrammarErrorCode.UNSUPPORTED, problem)


def _choice_error(options: Any) -> GrammarError | None:
    if not isinstance(options, list) or not options:
        return GrammarError(GrammarErrorCode.INVALID, "choice must be a non-empty list of strings.")
    if len(options) > MAX_CHOICES:
        return GrammarError(
            GrammarErrorCode.TOO_LARGE, f"choice may list at most {MAX_CHOICES} options."
        )
    if not all(isinstance(option, str) and option for option in options):
        return GrammarError(GrammarErrorCode.INVALID, "each choice must be a non-empty string.")
    return None


def _structural_tag_error(tag: Any) -> GrammarError | None:
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or "format" not in tag:
        return GrammarError(
            GrammarErrorCode.INVALID,
            'A structural tag is {"type": "structural_tag", "format": {...}}.',
        )
    for path, schema in _tag_schemas(tag["format"], "format"):
        error = _schema_error(schema, f"In {path}: ")
        if error is not None:
            return error
    return None


def _tag_schemas(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, schema) of every `json_schema` format nested in a structural tag format."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield f"{path}.json_schema", node["json_schema"]
        for key, value in node.items():
            if key != "json_schema":
                yield from _tag_schemas(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _tag_schemas(value, f"{path}[{i}]")
