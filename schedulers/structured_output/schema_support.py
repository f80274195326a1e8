"""Which JSON schemas (and regexes) the grammar can enforce; checked before compiling.

xgrammar compiles most of JSON Schema into its grammar, but it silently ignores some
keywords, so a schema using them would yield outputs that do not validate. Measured on
xgrammar 0.2.9 (docs/structured-outputs.md has the table): `not`, `if`/`then`/`else`,
`dependentRequired`/`dependentSchemas`/`dependencies`, `contains`/`minContains`/
`maxContains`, `uniqueItems: true`, `allOf` with more than one schema, `oneOf` (decoded as
`anyOf`, so it is only safe when its branches cannot match the same value), `multipleOf`
other than an integer on an integer, `$ref` to anything but a local JSON pointer, keywords
beside `$ref`, `minLength`/`maxLength` beside `pattern` or `format`, and regex lookaround,
backreferences, `\\b`, `\\A`/`\\Z`, `\\p{..}` and inline flags. Those are refused here, by
name and location, instead of being dropped.

One more xgrammar bug is worked around rather than refused: a string with `minLength` /
`maxLength` compiles to a rule that admits raw control characters (invalid JSON), so
`for_xgrammar` rewrites it to the equivalent `pattern` `^.{min,max}$`, whose rule is exact.

Every pass here is linear in the schema's size (the `oneOf` check groups branches by type and
by their `const` values instead of comparing every pair, except in small lists), and each
can run under a time budget (`schema_budget`): past it, `SchemaBudgetExceeded` ends the work
wherever it is, so a request-controlled schema costs its request a bounded time.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import time
from collections.abc import Iterator
from typing import Any, Literal

Problem = tuple[Literal["invalid", "unsupported", "too_large", "too_deep"], str]

#: the drafts a schema may declare in `$schema` (http or https, with or without a final '#')
KNOWN_DRAFTS = {
    "json-schema.org/draft-04/schema",
    "json-schema.org/draft-06/schema",
    "json-schema.org/draft-07/schema",
    "json-schema.org/draft/2019-09/schema",
    "json-schema.org/draft/2020-12/schema",
}
#: deepest nesting of subschemas accepted (OpenAI allows 10 levels of objects)
MAX_SCHEMA_DEPTH = 64
#: deepest nesting of JSON objects and arrays accepted in a schema or structural tag: what
#: `MAX_SCHEMA_DEPTH` subschemas under `properties` take (two each), with room for values.
#: NOTE: checked first, without recursion; everything after it (copies, jsonschema-rs,
#: xgrammar) may then recurse safely: the stack holds ~2 frames per level
MAX_JSON_DEPTH = 256
#: `oneOf` lists no longer than this may be checked pair by pair when grouping cannot tell
MAX_PAIRWISE_BRANCHES = 16
#: annotations: they change nothing a grammar accepts (dropped from a spec's normalised form)
ANNOTATION_KEYWORDS = (
    "description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
)  # fmt: skip

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "schema_deadline", default=None
)


class SchemaBudgetExceeded(Exception):
    """The schema work of this context ran past its `schema_budget`."""

    budget_s: float = 0.0

    def __str__(self) -> str:
        return f"Checking the schemas took longer than the {self.budget_s:g} s budget."


@contextlib.contextmanager
def schema_budget(seconds: float) -> Iterator[None]:
    """Bound the schema work done in this context (this thread) to `seconds` of wall time:
    past it, the passes here raise `SchemaBudgetExceeded`."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    except SchemaBudgetExceeded as exc:
        exc.budget_s = seconds
        raise
    finally:
        _deadline.reset(token)


def check_budget() -> None:
    """Raise `SchemaBudgetExceeded` when this context's budget is spent (cheap: call often)."""
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise SchemaBudgetExceeded


_NEVER_ENFORCED = {
    "not": "'not'",
    "if": "'if'/'then'/'else'",
    "then": "'if'/'then'/'else'",
    "else": "'if'/'then'/'else'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
    "$dynamicRef": "'$dynamicRef'",
    "$recursiveRef": "'$recursiveRef'",
}
#: keywords that do not constrain values: allowed beside `$ref`
_ANNOTATIONS = {
    "$ref", "$defs", "definitions", "$schema", "$id", "$comment", "$anchor", "title",
    "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "discriminator",
}  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
    "items", "additionalItems", "contains", "not", "if", "then", "else",
)  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")


def json_schema_problem(schema: Any) -> Problem | None:
    """Why `schema` cannot be served, or None: not a valid JSON schema (checked against the
    meta-schema of its `$schema` draft, 2020-12 by default), or a feature the grammar does
    not enforce, named with its JSON pointer.

    NOTE: the meta-schema check is jsonschema-rs (~1 ms for 25 KB, where the pure-Python
    `jsonschema` takes ~200 ms holding the GIL). It would fetch an unknown `$schema` URL, so
    any `$schema` other than a known draft is refused first: nothing is ever fetched.
    """
    if not isinstance(schema, dict | bool):
        return "invalid", "A JSON schema must be an object or a boolean."
    if schema is False:
        return "invalid", "The schema `false` matches nothing."
    if nested_deeper_than(schema, MAX_JSON_DEPTH):
        return "too_deep", f"The schema nests objects and arrays over {MAX_JSON_DEPTH} levels deep."
    subschemas = list(_subschemas(schema))
    for pointer, node, depth in subschemas:
        if depth > MAX_SCHEMA_DEPTH:
            return "too_deep", f"The schema nests subschemas over {MAX_SCHEMA_DEPTH} levels deep."
        draft = node.get("$schema")
        if draft is not None and _draft_key(draft) not in KNOWN_DRAFTS:
            return "invalid", f"Unknown '$schema' {draft!r} at {pointer or '/'}."
    # NOTE: imported here, not at module level: the engine imports this module, and the GPU
    # image (torch, transformers, no registry) has no jsonschema_rs; only a request with a
    # schema needs it, and structured outputs need xgrammar there anyway
    import jsonschema_rs

    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as error:
        where = _pointer(error.instance_path)
        return "invalid", f"Invalid JSON schema at {where}: {error.message}"
    except jsonschema_rs.ReferencingError as error:
        return "invalid", f"Invalid JSON schema: {error}"
    for pointer, node, _ in subschemas:
        message = _unenforced(node, schema)
        if message is not None:
            return "unsupported", f"Unsupported JSON schema feature at {pointer or '/'}: {message}"
    empty = _first_matching_nothing(subschemas, schema)
    if empty is not None:
        return "invalid", (
            f"The subschema at {empty or '/'} matches no value: its '$ref' / 'anyOf' / 'oneOf' "
            "/ 'allOf' lead only back to themselves (give the cycle a branch that is a schema)."
        )
    return None


_ALIASES = ("anyOf", "oneOf", "allOf")  # NOTE: allOf has one schema here (more are refused)


def _first_matching_nothing(
    subschemas: list[tuple[str, dict[str, Any], int]], root: Any
) -> str | None:
    """The pointer of a subschema that can match nothing because it only aliases others in a
    cycle (`{"anyOf": [{"$ref": "#"}]}`), or None. xgrammar compiles such a rule, and the
    output then reaches a point where no token is allowed.

    Each `$ref`, `anyOf`, `oneOf` and `allOf` of a subschema is a group of alternatives (any
    member will do); a subschema matches something once each of its groups has a member that
    does, and one without groups does. A worklist from those: linear in the schema."""
    unmet: dict[int, int] = {}  # subschema -> its groups without a matching member yet
    groups: list[tuple[int, list[Any]]] = []  # (the subschema, its members)
    waiting: dict[int, list[int]] = {}  # member subschema -> the groups it is in
    for _, node, _ in subschemas:
        alternatives = _alternatives(node, root)
        unmet[id(node)] = len(alternatives)
        for members in alternatives:
            for member in members:
                waiting.setdefault(id(member), []).append(len(groups))
            groups.append((id(node), members))
    queue = [ident for ident, count in unmet.items() if count == 0]
    met: set[int] = set()

    def meet(group: int) -> None:
        if group not in met:
            met.add(group)
            owner = groups[group][0]
            unmet[owner] -= 1
            if unmet[owner] == 0:
                queue.append(owner)

    for group, (_, members) in enumerate(groups):
        if any(_outside(member, unmet) for member in members):
            meet(group)
    matching: set[int] = set()
    while queue:
        check_budget()
        ident = queue.pop()
        if ident not in matching:
            matching.add(ident)
            for group in waiting.get(ident, []):
                meet(group)
    return next((pointer for pointer, node, _ in subschemas if id(node) not in matching), None)


def _outside(member: Any, subschemas: dict[int, int]) -> bool:
    """Whether an alias member matches something without being one of the subschemas:
    `true`, or a `$ref` target elsewhere (an unresolved one is refused by other checks)."""
    return id(member) not in subschemas if isinstance(member, dict) else member is not False


def _alternatives(node: dict[str, Any], root: Any) -> list[list[Any]]:
    """The member lists of `node`'s aliasing keywords (one hop of `$ref`)."""
    found: list[list[Any]] = []
    if isinstance(node.get("$ref"), str):
        found.append([_resolve(node, root, hops=1)])
    found.extend(node[key] for key in _ALIASES if isinstance(node.get(key), list) and node[key])
    return found


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects and arrays more than `limit` levels deep (the root
    container is level 1). Iterative: any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _draft_key(uri: Any) -> str:
    text = str(uri).rstrip("#")
    return text.split("://", 1)[-1]


def for_xgrammar(schema: Any) -> Any:
    """A copy of `schema` that xgrammar compiles exactly: length-bounded strings without a
    `pattern` or `format` become the pattern `^.{min,max}$` (same values, valid JSON)."""
    if not isinstance(schema, dict):
        return schema
    rewritten = copy.deepcopy(schema)
    for _, node, _ in _subschemas(rewritten):
        types = node.get("type", "string")
        is_string = types == "string" or isinstance(types, list) and "string" in types
        has_length = "minLength" in node or "maxLength" in node
        if is_string and has_length and "pattern" not in node and "format" not in node:
            low = int(node.pop("minLength", 0))
            high = node.pop("maxLength", None)
            node["pattern"] = f"^.{{{low},{'' if high is None else int(high)}}}$"
    return rewritten


def without_annotations(schema: Any, copy: bool = True) -> Any:
    """`schema` without the annotation keywords of its subschemas (property names are kept)."""
    stripped = _deepcopy(schema) if copy else schema
    for _, node, _ in _subschemas(stripped):
        for key in ANNOTATION_KEYWORDS:
            node.pop(key, None)
    return stripped


def _deepcopy(value: Any) -> Any:
    return copy.deepcopy(value)


def regex_problem(pattern: str) -> str | None:
    """What in `pattern` xgrammar's regex engine does not implement, or None."""
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        nxt = pattern[i + 1] if i + 1 < len(pattern) else ""
        if c == "\\":
            if nxt in "123456789":
                return f"regex backreference '\\{nxt}' is not supported."
            if nxt in "kbBpPAZz":
                return f"regex escape '\\{nxt}' is not supported."
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]" or pattern[i + 1 : i + 3] == "^]":
                i += 2 if nxt == "]" else 3  # a leading ']' is a literal
                continue
        elif c == "(" and nxt == "?" and pattern[i + 2 : i + 3] != ":":
            return "regex lookaround, named groups and inline flags ('(?...)') are not supported."
        i += 1
    return None


def _pointer(path: Any) -> str:
    """A JSON pointer ("/properties/a") for a jsonschema error path."""
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else "/"


def _subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(JSON pointer, subschema, depth) of every object subschema, root first (no recursion:
    a deep schema cannot overflow the stack)."""
    stack: list[tuple[str, Any, int]] = [("", schema, 0)]
    while stack:
        pointer, node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        check_budget()
        yield pointer, node, depth
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                for name, child in value.items():
                    stack.append((f"{pointer}/{key}/{_escape(name)}", child, depth + 1))
        for key in _SCHEMA_VALUES:
            if isinstance(node.get(key), dict):
                stack.append((f"{pointer}/{key}", node[key], depth + 1))
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                for i, child in enumerate(value):
                    stack.append((f"{pointer}/{key}/{i}", child, depth + 1))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unenforced(node: dict[str, Any], root: Any) -> str | None:
    """What in this one subschema (not its children) the grammar would not enforce."""
    for key, label in _NEVER_ENFORCED.items():
        if key in node:
            return f"{label} is not enforced by the grammar."
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced by the grammar."
    if ("minLength" in node or "maxLength" in node) and ("pattern" in node or "format" in node):
        return "'minLength'/'maxLength' beside 'pattern' or 'format' are not enforced."
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema is not enforced by the grammar."
    if "multipleOf" in node:
        divisor = node["multipleOf"]
        if node.get("type") != "integer" or isinstance(divisor, float) and not divisor.is_integer():
            return "'multipleOf' is enforced only as a whole number on 'type': 'integer'."
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return f"only local '$ref's ('#/...') are supported, got {ref!r}."
        if _resolve(node, root) is None:
            return f"'$ref' {ref!r} does not resolve within the schema."
        siblings = sorted(set(node) - _ANNOTATIONS)
        if siblings:
            return f"keywords beside '$ref' are ignored by the grammar: {', '.join(siblings)}."
    for pattern in _patterns(node):
        problem = regex_problem(pattern)
        if problem is not None:
            return problem
    if isinstance(node.get("oneOf"), list) and not _pairwise_disjoint(node["oneOf"], root):
        return (
            "'oneOf' is enforced as 'anyOf', so its branches must not match the same value "
            "(give them distinct types, or a required property with distinct 'const' values)."
        )
    return None


def _patterns(node: dict[str, Any]) -> Iterator[str]:
    if isinstance(node.get("pattern"), str):
        yield node["pattern"]
    if isinstance(node.get("patternProperties"), dict):
        yield from node["patternProperties"]


def _resolve(schema: Any, root: Any, hops: int = 32) -> Any:
    """`schema` with local `$ref`s followed (None when one does not resolve)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and hops > 0:
        ref = schema["$ref"]
        if not (ref == "#" or ref.startswith("#/")):
            return None
        target = root
        for raw in ref[2:].split("/") if ref != "#" else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        schema, hops = target, hops - 1
    return schema


def _pairwise_disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no value matches two branches. Linear: branches of disjoint types never
    overlap, so only those sharing a type are compared, by their consts or a required
    discriminating property's consts (hashed); a small group may be compared pair by pair."""
    resolved = [_resolve(b, root) for b in branches]
    if any(b is False for b in resolved):
        resolved = [b for b in resolved if b is not False]
    if not all(isinstance(b, dict) for b in resolved):
        return len(resolved) <= 1
    groups: dict[str, list[dict[str, Any]]] = {}
    if all(_types(b) is not None for b in resolved):
        for branch in resolved:
            for kind in {_TYPE_CLASS.get(t, t) for t in _types(branch) or ()}:
                groups.setdefault(kind, []).append(branch)
    else:
        groups[""] = resolved
    return all(_group_disjoint(group, root) for group in groups.values())


_TYPE_CLASS = {"integer": "number"}  # an integer is also a number


def _group_disjoint(group: list[dict[str, Any]], root: Any) -> bool:
    if len(group) <= 1:
        return True
    if _distinct_values([_consts(b) for b in group]):
        return True
    common = set(group[0].get("required") or ())
    for branch in group[1:]:
        check_budget()
        common &= set(branch.get("required") or ())
    for name in sorted(common, key=str)[:8]:
        values = []
        for branch in group:
            prop = _resolve((branch.get("properties") or {}).get(name), root)
            values.append(_consts(prop) if isinstance(prop, dict) else None)
        if _distinct_values(values):
            return True
    if len(group) > MAX_PAIRWISE_BRANCHES:
        return False
    return all(_disjoint(a, b, root) for i, a in enumerate(group) for b in group[i + 1 :])


def _distinct_values(per_branch: list[list[Any] | None]) -> bool:
    """Whether every branch lists its values and no value is in two branches."""
    seen: set[str] = set()
    for values in per_branch:
        check_budget()
        if values is None:
            return False
        keys = {_json_key(v) for v in values}
        if not seen.isdisjoint(keys):
            return False
        seen |= keys
    return True


def _json_key(value: Any) -> str:
    """A hashable key with JSON equality: 1 and 1.0 alike, true and 1 not."""
    return json.dumps(_integral(value), sort_keys=True)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _disjoint(a: Any, b: Any, root: Any) -> bool:
    """Whether no value can match both `a` and `b` (provably, by types, consts or a
    discriminating required property); False when unsure."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not _types_overlap(types_a, types_b):
        return True
    consts_a, consts_b = _consts(a), _consts(b)
    if consts_a is not None and consts_b is not None:
        return not any(_eq(x, y) for x in consts_a for y in consts_b)
    required = set(a.get("required") or ()) & set(b.get("required") or ())
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    for name in required:
        pa, pb = _resolve(props_a.get(name), root), _resolve(props_b.get(name), root)
        ca = _consts(pa) if isinstance(pa, dict) else None
        cb = _consts(pb) if isinstance(pb, dict) else None
        if ca is not None and cb is not None and not any(_eq(x, y) for x in ca for y in cb):
            return True
    return False


def _types(schema: dict[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {str(t) for t in declared}
    return None


def _types_overlap(a: set[str], b: set[str]) -> bool:
    widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
    return any(widen.get(t, {t}) & b for t in a)


def _consts(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    return None


def _eq(x: Any, y: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    return bool(x == y)
