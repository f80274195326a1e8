"""Tool calling around any chat template: validate tools, render them, constrain the calls.

The one call format (Hermes / Qwen2.5 style; docs/structured-outputs.md):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `check_tools` / `resolve_tool_choice` validate a request's `tools` and `tool_choice`
  (problems come back as values naming the `param`).
- `template_renders_tools(tokenizer)` tells whether the chat template uses `tools` (it
  renders a probe with and without one). When it does, `render_conversation` hands the
  template the tools and the history in Hugging Face's shape; when it does not (the default
  SmolLM2's), it writes the tool definitions into the system prompt and the history
  (assistant `tool_calls`, `role: tool` results) into plain messages, in the format above.
- `tool_grammar` is the constraint: `required` -> one or more valid calls of the allowed
  tools (exactly one when `parallel_tool_calls` is false), a named function -> one call of
  it, `auto` -> free text in which a call, once `<tool_call>` starts it, must be valid (or,
  with a `response_format`, either calls or an answer in that format). Arguments are
  constrained by each tool's `parameters` schema.
Pure Python: no torch, no xgrammar (`tool_call_parser.py` parses the calls back).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.api.outputs.tool_parser import TOOL_CALL_BEGIN, TOOL_CALL_END
from gateway.api.problems import ParamProblem
from schedulers.structured_output import GrammarKind, GrammarSpec, check_depth, check_spec

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: most tools one request may declare (OpenAI's limit)
MAX_TOOLS = 128
#: most bytes all of one request's tool `parameters` schemas may take together (compact JSON;
#: the grammar of the calls, which holds them all, is itself bounded by GrammarLimits)
MAX_TOOL_SCHEMA_BYTES = 256_000
_CALL_PREFIX = TOOL_CALL_BEGIN + '\n{"name": "'
_CALL_ARGUMENTS = '", "arguments": '
_CALL_SUFFIX = "}\n" + TOOL_CALL_END
_ANY_OBJECT = {"type": "object"}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "carousel_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


@dataclass(frozen=True)
class FunctionTool:
    """One validated function tool (`parameters` None: any JSON object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_openai(self) -> dict[str, Any]:
        """The Chat Completions shape, as templates and the tool prompt show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice` resolved: the mode and the tools the model may call."""

    mode: Literal["none", "auto", "required"]
    tools: tuple[FunctionTool, ...]
    forced: bool = False  # a named function: exactly one call of `tools[0]`


@dataclass(frozen=True)
class RenderedConversation:
    """Messages for `apply_chat_template`, and its `tools=` (None: already in the prompt)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def check_tools(
    tools: Sequence[Any] | None, param: str = "tools"
) -> list[FunctionTool] | ParamProblem:
    """Validate Chat Completions `tools` (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        return ParamProblem(param, f"At most {MAX_TOOLS} tools are allowed, got {len(tools)}.")
    out: list[FunctionTool] = []
    schema_bytes = 0
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping):
            return ParamProblem(where, "Each tool must be an object.")
        if tool.get("type") != "function":
            return ParamProblem(
                f"{where}.type",
                f"Tools of type {tool.get('type')!r} are not supported; only 'function' is.",
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            return ParamProblem(f"{where}.function", "Missing required parameter: 'function'.")
        checked = check_function(function, f"{where}.function")
        if isinstance(checked, ParamProblem):
            return checked
        if any(t.name == checked.name for t in out):
            return ParamProblem(f"{where}.function.name", f"Duplicate tool name {checked.name!r}.")
        if checked.parameters is not None:
            schema_bytes += len(GrammarSpec.json_schema(checked.parameters).text.encode())
            if schema_bytes > MAX_TOOL_SCHEMA_BYTES:
                return ParamProblem(
                    f"{where}.function.parameters",
                    f"The tools' parameters schemas take more than {MAX_TOOL_SCHEMA_BYTES} "
                    "bytes together.",
                    "grammar_too_large",
                )
        out.append(checked)
    return out


def check_function(function: Mapping[str, Any], where: str) -> FunctionTool | ParamProblem:
    """Validate one function definition (`name`, `description`, `parameters`)."""
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        return ParamProblem(
            f"{where}.name",
            f"Invalid tool name {name!r}: it must be 1-64 characters of a-z, A-Z, 0-9, "
            "underscores and dashes.",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        return ParamProblem(f"{where}.description", "'description' must be a string.")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            return ParamProblem(f"{where}.parameters", "'parameters' must be a JSON schema object.")
        error = check_depth(parameters) or check_spec(GrammarSpec.json_schema(parameters))
        if error is not None:
            return ParamProblem(f"{where}.parameters", error.message, str(error.code))
        parameters = dict(parameters)
    return FunctionTool(name, description, parameters)


def resolve_tool_choice(
    tool_choice: Any, tools: Sequence[FunctionTool], param: str = "tool_choice"
) -> ToolChoice | ParamProblem:
    """`tool_choice` (`none`/`auto`/`required`, a named function, or `allowed_tools`)
    against the declared tools. Without tools, only `none`/`auto`/absent are valid."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice("none", ())
    if tool_choice in ("auto", "required"):
        if not tools:
            if tool_choice == "auto":
                return ToolChoice("none", ())
            return ParamProblem(param, "tool_choice 'required' needs at least one tool in 'tools'.")
        return ToolChoice(tool_choice, tuple(tools))
    if not isinstance(tool_choice, Mapping):
        return ParamProblem(
            param,
            f"Invalid tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
        )
    kind = tool_choice.get("type")
    if kind == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
        named = _find(tools, name)
        if named is None:
            return ParamProblem(
                f"{param}.function.name" if isinstance(function, Mapping) else f"{param}.name",
                f"tool_choice names the function {name!r}, which is not in 'tools'.",
            )
        return ToolChoice("required", (named,), forced=True)
    if kind == "allowed_tools":
        allowed = tool_choice.get("allowed_tools", tool_choice)
        mode = allowed.get("mode") if isinstance(allowed, Mapping) else None
        refs = allowed.get("tools") if isinstance(allowed, Mapping) else None
        if mode not in ("auto", "required") or not isinstance(refs, list) or not refs:
            return ParamProblem(param, "allowed_tools needs a mode ('auto'/'required') and tools.")
        chosen = []
        for j, ref in enumerate(refs):
            ref_name = _ref_name(ref)
            tool = _find(tools, ref_name)
            if tool is None:
                return ParamProblem(
                    f"{param}.allowed_tools.tools[{j}]",
                    f"allowed_tools names {ref_name!r}, which is not in 'tools'.",
                )
            chosen.append(tool)
        return ToolChoice(mode, tuple(chosen))
    return ParamProblem(f"{param}.type", f"tool_choice of type {kind!r} is not supported.")


def tool_grammar(
    choice: ToolChoice, parallel_tool_calls: bool = True, answer: GrammarSpec | None = None
) -> GrammarSpec | None:
    """The constraint for `choice` (see the module docstring); None when nothing is
    constrained. `answer` is the request's own output format (`response_format` /
    `text.format`): under `auto` the output is then either calls or an answer in that
    format; a required or named call ignores it; without tools it is the constraint."""
    if choice.mode == "none" or not choice.tools:
        return answer
    tags = [_call_tag(tool) for tool in choice.tools]
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not parallel_tool_calls,
    }
    if choice.forced:
        fmt: dict[str, Any] = tags[0]
    elif choice.mode == "required":
        fmt = calls
    elif answer is not None:
        fmt = {"type": "or", "elements": [calls, _answer_format(answer)]}
    else:
        fmt = {
            "type": "triggered_tags",
            "triggers": [TOOL_CALL_BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel_tool_calls,
        }
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


def _answer_format(spec: GrammarSpec) -> dict[str, Any]:
    """`spec` as a structural-tag format (to offer it beside tool calls)."""
    if spec.kind is GrammarKind.JSON_SCHEMA or spec.kind is GrammarKind.JSON_OBJECT:
        schema = json.loads(spec.text) if spec.kind is GrammarKind.JSON_SCHEMA else _ANY_OBJECT
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if spec.kind is GrammarKind.REGEX:
        return {"type": "regex", "pattern": spec.text}
    if spec.kind is GrammarKind.GRAMMAR:
        return {"type": "grammar", "grammar": spec.text}
    if spec.kind is GrammarKind.CHOICE:
        options = [{"type": "const_string", "value": c} for c in spec.choices()]
        return {"type": "or", "elements": options}
    format_: dict[str, Any] = json.loads(spec.text)["format"]
    return format_


def _call_tag(tool: FunctionTool) -> dict[str, Any]:
    schema: dict[str, Any] | bool = tool.parameters if tool.parameters is not None else True
    return {
        "type": "tag",
        "begin": _CALL_PREFIX + tool.name + _CALL_ARGUMENTS,
        # NOTE: at most one whitespace between JSON tokens: a small model cannot loop on
        # newlines inside the arguments until max_tokens
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
        "end": _CALL_SUFFIX,
    }


def _ref_name(ref: Any) -> Any:
    """The function name of a tool reference, nested (`function.name`) or flat (`name`)."""
    if not isinstance(ref, Mapping):
        return None
    function = ref.get("function")
    return function.get("name") if isinstance(function, Mapping) else ref.get("name")


def _find(tools: Sequence[FunctionTool], name: Any) -> FunctionTool | None:
    return next((t for t in tools if t.name == name), None)


# -- rendering ---------------------------------------------------------------------------


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template uses `tools=` (a probe renders differently)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that cannot take tools does not render them
        return False
    return bool(plain != with_tools)


def tool_prompt(tools: Sequence[FunctionTool]) -> str:
    """The system-prompt block that shows `tools` to a model whose template ignores them."""
    definitions = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{definitions}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {TOOL_CALL_BEGIN}{TOOL_CALL_END} XML tags:\n"
        f'{TOOL_CALL_BEGIN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{TOOL_CALL_END}"
    )


def format_tool_call(name: str, arguments: str) -> str:
    """One call as the model writes it (arguments re-spaced compactly when they parse)."""
    with contextlib.suppress(ValueError):
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    return f"{_CALL_PREFIX}{name}{_CALL_ARGUMENTS}{arguments}{_CALL_SUFFIX}"


def render_conversation(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[FunctionTool],
    *,
    renders_tools: bool,
    param: str = "messages",
) -> RenderedConversation | ParamProblem:
    """`messages` (Chat Completions shape, dicts) and the tools to show, ready for the chat
    template: see the module docstring. Checks that each `tool` message has a
    `tool_call_id` answering an earlier assistant `tool_calls` entry."""
    call_ids: set[str] = set()
    out: list[dict[str, Any]] = []
    results_turn: int | None = None  # the user turn collecting consecutive tool results
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                return ParamProblem(
                    f"{where}.tool_call_id", "Missing required parameter: 'tool_call_id'."
                )
            if call_id not in call_ids:
                return ParamProblem(
                    f"{where}.tool_call_id",
                    f"Invalid 'tool_call_id' {call_id!r}: a tool message must answer a "
                    "preceding assistant message's 'tool_calls'.",
                )
            content = _text(message.get("content"))
            if renders_tools:
                turn = {"role": "tool", "tool_call_id": call_id, "content": content}
                out.append({**turn, "name": message["name"]} if message.get("name") else turn)
            elif results_turn is not None:
                out[results_turn]["content"] += "\n" + _tool_response(content)
            else:
                results_turn = len(out)
                out.append({"role": "user", "content": _tool_response(content)})
            continue
        results_turn = None
        if role == "assistant" and message.get("tool_calls"):
            calls = _check_calls(message["tool_calls"], f"{where}.tool_calls")
            if isinstance(calls, ParamProblem):
                return calls
            call_ids.update(call_id for call_id, _, _ in calls)
            out.append(_assistant_turn(_text(message.get("content")), calls, renders_tools))
        else:
            out.append({**message, "content": _text(message.get("content"))})
    if renders_tools:
        return RenderedConversation(out, [t.as_openai() for t in tools] or None)
    if tools:
        block = tool_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return RenderedConversation(out, None)


def _check_calls(calls: Any, where: str) -> list[tuple[str, str, str]] | ParamProblem:
    """(id, name, arguments) of an assistant message's `tool_calls`."""
    if not isinstance(calls, list):
        return ParamProblem(where, "'tool_calls' must be a list.")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            return ParamProblem(f"{at}.function", "Missing required parameter: 'function'.")
        call_id, name = call.get("id"), function.get("name")
        arguments = function.get("arguments", "{}")
        if not isinstance(call_id, str) or not call_id:
            return ParamProblem(f"{at}.id", "Missing required parameter: 'id'.")
        if not isinstance(name, str) or not name:
            return ParamProblem(f"{at}.function.name", "Missing required parameter: 'name'.")
        if not isinstance(arguments, str):
            return ParamProblem(f"{at}.function.arguments", "'arguments' must be a JSON string.")
        out.append((call_id, name, arguments))
    return out


def _assistant_turn(
    content: str, calls: list[tuple[str, str, str]], renders_tools: bool
) -> dict[str, Any]:
    if renders_tools:  # Hugging Face templates take arguments as a dict
        tool_calls = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": _loads(a)}}
            for call_id, name, a in calls
        ]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}
    blocks = [format_tool_call(name, arguments) for _, name, arguments in calls]
    return {"role": "assistant", "content": "\n".join([content, *blocks] if content else blocks)}


def _tool_response(content: str) -> str:
    """A tool result as a model whose template ignores tools reads it (Qwen2.5's layout)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _text(content: Any) -> str:
    """A message's content as one string (text parts joined by newlines; None -> "")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "\n".join(str(p) for p in parts)
    return str(content)


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
