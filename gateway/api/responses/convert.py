"""A Responses API request (and the conversation before it) as a chat request.

`to_chat(request, history)` turns `instructions` + the stored history of
`previous_response_id` + this request's `input` into Chat Completions messages, its function
tools and `tool_choice` into the chat shapes `tool_calls.py` validates, and `text.format`
into the answer's `GrammarSpec`. Everything it cannot serve comes back as a `ParamProblem`
naming the Responses `param` (`input[2].content[0].type`, `tools[0].type`, ...).

History is kept as Responses items (what `input` may hold): `conversation_after` appends a
turn's input items and output items, and that list is what the response store keeps for
the next `previous_response_id`. `instructions` are not part of it: as in OpenAI's API
they apply to one request only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.api.outputs.response_format import grammar_for_text_format
from gateway.api.problems import ParamProblem
from gateway.api.responses.protocol import ResponseObject, ResponsesRequest, new_id
from schedulers.structured_output import GrammarSpec

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_BUILT_IN_CHOICES = ("file_search", "web_search", "web_search_preview", "computer_use_preview",
                     "code_interpreter", "image_generation", "mcp", "custom")  # fmt: skip

#: the id prefix OpenAI gives each kind of stored item
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass(frozen=True)
class ChatParts:
    """A Responses request as chat: hand these to the chat pipeline (tool_calls.py, the
    chat template, the grammar compiler)."""

    messages: list[dict[str, Any]]  # Chat Completions messages, instructions first
    tools: list[dict[str, Any]]  # `{"type": "function", "function": {...}}`
    tool_choice: Any  # chat shape, or None
    parallel_tool_calls: bool
    answer: GrammarSpec | None  # from text.format
    input_items: list[dict[str, Any]]  # this request's input, as items (for the store)


def to_chat(
    request: ResponsesRequest, history: Sequence[Mapping[str, Any]] = ()
) -> ChatParts | ParamProblem:
    """See the module docstring; `history` is the stored conversation of
    `previous_response_id` (empty without one)."""
    input_items = _input_items(request.input)
    if isinstance(input_items, ParamProblem):
        return input_items
    messages = items_to_messages([*history, *input_items], first_param=-len(history))
    if isinstance(messages, ParamProblem):
        return messages
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    tools = _chat_tools(request.tools or [])
    if isinstance(tools, ParamProblem):
        return tools
    tool_choice = _chat_tool_choice(request.tool_choice)
    if isinstance(tool_choice, ParamProblem):
        return tool_choice
    answer = grammar_for_text_format(request.text)
    if isinstance(answer, ParamProblem):
        return answer
    return ChatParts(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        answer=answer,
        input_items=input_items,
    )


def response_skeleton(request: ResponsesRequest, model: str) -> ResponseObject:
    """The response object before any output (`status: in_progress`), echoing the request's
    settings as OpenAI does."""
    return ResponseObject(
        created_at=int(time.time()),
        model=model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        temperature=request.temperature,
        top_p=request.top_p,
        tool_choice=request.tool_choice or "auto",
        tools=[dict(tool) for tool in request.tools or []],
        text=dict(request.text) if request.text else {"format": {"type": "text"}},
        store=request.store is not False,
        metadata=dict(request.metadata or {}),
        user=request.user,
    )


def conversation_after(
    history: Sequence[Mapping[str, Any]],
    input_items: Sequence[Mapping[str, Any]],
    response: ResponseObject,
) -> list[dict[str, Any]]:
    """The conversation through `response`: what `previous_response_id` continues from.
    Input items without an `id` get one (`GET /v1/responses/{id}/input_items` pages by it)."""
    output = [item.model_dump() for item in response.output]
    return [*map(dict, history), *map(_with_id, input_items), *output]


def _with_id(item: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(item.get("id"), str):
        return dict(item)
    prefix = _ID_PREFIXES.get(str(item.get("type", "message")), "item")
    return {"id": new_id(prefix), **item}


def items_to_messages(
    items: Sequence[Mapping[str, Any]], first_param: int = 0
) -> list[dict[str, Any]] | ParamProblem:
    """Responses items -> chat messages. Item i is `input[i + first_param]` in problems
    (history items, at negative indexes, were checked when they were stored).

    Consecutive `function_call` items join one assistant message (after its text, if the
    model wrote some); each `function_call_output` is a `tool` message, and must answer a
    call made earlier in the conversation.
    """
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for offset, item in enumerate(items):
        param = f"input[{offset + first_param}]"
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, param)
            if isinstance(message, ParamProblem):
                return message
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, param)
            if isinstance(call, ParamProblem):
                return call
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                return ParamProblem(
                    f"{param}.call_id",
                    f"No function_call with call_id {call_id!r} precedes this "
                    "function_call_output.",
                )
            output = _text_of(item.get("output"), f"{param}.output")
            if isinstance(output, ParamProblem):
                return output
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            return ParamProblem(
                f"{param}.type",
                f"Input items of type {kind!r} are not supported; only 'message', "
                "'function_call' and 'function_call_output' are.",
                "unsupported_parameter",
            )
    return messages


def _input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]] | ParamProblem:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        return ParamProblem("input", "'input' must not be empty.")
    return [dict(item) for item in value]


def _message(item: Mapping[str, Any], param: str) -> dict[str, Any] | ParamProblem:
    role = item.get("role")
    if role not in _ROLES:
        return ParamProblem(
            f"{param}.role", f"Invalid role {role!r}; expected one of {', '.join(_ROLES)}."
        )
    text = _text_of(item.get("content"), f"{param}.content")
    if isinstance(text, ParamProblem):
        return text
    return {"role": role, "content": text}


def _function_call(item: Mapping[str, Any], param: str) -> dict[str, Any] | ParamProblem:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            return ParamProblem(f"{param}.{key}", f"Missing required parameter: '{key}'.")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _text_of(content: Any, param: str) -> str | ParamProblem:
    """A content string, or the text of a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ParamProblem(param, "Content must be a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "refusal":
            texts.append(str(part.get("refusal", "")))
            continue
        if kind not in _TEXT_PARTS:
            return ParamProblem(
                f"{param}[{j}].type",
                f"Content parts of type {kind!r} are not supported; only text is.",
                "unsupported_parameter",
            )
        text = part.get("text")
        if not isinstance(text, str):
            return ParamProblem(f"{param}[{j}].text", "Missing required parameter: 'text'.")
        texts.append(text)
    return "\n".join(texts)


def _chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | ParamProblem:
    """Responses function tools (flat) -> chat tools (nested under `function`)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            return ParamProblem(
                f"tools[{i}].type",
                f"Built-in tools such as {tool.get('type')!r} are not supported; only "
                "'function' tools are.",
                "unsupported_parameter",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses `tool_choice` -> chat's (`{"type": "function", "name"}` -> nested)."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":
        return dict(choice)
    if kind in _BUILT_IN_CHOICES or kind is not None:
        return ParamProblem(
            "tool_choice",
            f"tool_choice {kind!r} is not supported; use 'none', 'auto', 'required' or a function.",
            "unsupported_parameter",
        )
    return ParamProblem("tool_choice.type", "Missing required parameter: 'type'.")
