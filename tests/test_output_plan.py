"""A request's output plan (gateway/api/outputs/plan.py): which param each refusal names, and how
the compiler's answers become OpenAI errors, before anything is queued. Pure: the compiler
is a stand-in returning resolved futures (tests/test_structured_live.py runs the real one)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import pytest

from gateway.api.errors import APIError
from gateway.api.outputs.plan import (
    OutputPlan,
    chat_plan,
    completion_plan,
    finish_compile,
    start_compile,
)
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarError,
    GrammarErrorCode,
    GrammarKind,
    GrammarSpec,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat(**body: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body})


def refusal(make: Any, **body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        make(**body)
    return info.value


class StandIn:
    """A compiler whose every submit resolves at once to `result`."""

    def __init__(self, result: CompiledGrammar | GrammarError) -> None:
        self.result = result
        self.submitted: list[GrammarSpec] = []

    def submit(
        self, spec: GrammarSpec, principal: str = "anonymous"
    ) -> Future[CompiledGrammar | GrammarError]:
        self.submitted.append(spec)
        future: Future[CompiledGrammar | GrammarError] = Future()
        future.set_result(self.result)
        return future


def compile_with(result: CompiledGrammar | GrammarError, plan: OutputPlan) -> Any:
    return asyncio.run(finish_compile(start_compile(StandIn(result), plan), plan))  # type: ignore[arg-type]


def test_each_spelling_names_its_own_param() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    plan = chat_plan(chat(response_format=schema_format))
    assert plan.spec is not None and plan.spec.kind is GrammarKind.JSON_SCHEMA
    assert plan.spec_param == "response_format.json_schema.schema"
    assert not plan.parses_tools
    assert chat_plan(chat(response_format={"type": "json_object"})).spec_param == "response_format"
    plan = completion_plan(
        CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "a+"})
    )
    assert plan.spec == GrammarSpec.regex("a+") and plan.spec_param == "structured_outputs.regex"
    plan = chat_plan(chat(tools=[WEATHER], tool_choice="required"))
    assert plan.spec is not None and plan.spec.kind is GrammarKind.STRUCTURAL_TAG
    assert plan.spec_param == "tools" and plan.parses_tools
    assert chat_plan(chat(response_format={"type": "text"})) == OutputPlan()


def test_tool_choice_none_shows_no_tools_and_parses_nothing() -> None:
    plan = chat_plan(chat(tools=[WEATHER], tool_choice="none"))
    assert plan.spec is None and not plan.parses_tools and plan.shown_tools == ()
    assert len(plan.tools) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),  # fmt: skip
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
            "structured_outputs",
        ),  # fmt: skip
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        (
            {
                "tools": [WEATHER],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}},
                },
            },
            "response_format.json_schema.schema",
        ),  # fmt: skip
    ],
)
def test_bad_plans_are_400s_naming_the_param(body: dict[str, Any], param: str) -> None:
    error = refusal(lambda: chat_plan(chat(**body)))
    assert error.status_code == 400 and error.param == param, error.message


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (GrammarErrorCode.INVALID, 400),
        (GrammarErrorCode.UNSUPPORTED, 400),
        (GrammarErrorCode.TOO_LARGE, 400),
        (GrammarErrorCode.TIMEOUT, 400),
        (GrammarErrorCode.COMPILE, 400),
        (GrammarErrorCode.BUSY, 503),
    ],
)
def test_compiler_refusals_keep_their_code_and_name_the_param(
    code: GrammarErrorCode, status: int
) -> None:
    plan = chat_plan(chat(structured_outputs={"grammar": "root ::= x"}))
    with pytest.raises(APIError) as info:
        compile_with(GrammarError(code, "why"), plan)
    error = info.value
    assert (error.status_code, error.code, error.message) == (status, str(code), "why")
    if status == 400:
        assert error.param == "structured_outputs.grammar"
    else:
        assert error.headers["Retry-After"] == "1"


def test_a_compiled_grammar_is_handed_on_and_nothing_is_compiled_without_a_spec() -> None:
    plan = chat_plan(chat(response_format={"type": "json_object"}))
    compiled = CompiledGrammar(GrammarSpec.json_object(), object(), 1, 0.0)
    assert compile_with(compiled, plan) is compiled
    stand_in = StandIn(compiled)
    assert start_compile(stand_in, OutputPlan()) is None  # type: ignore[arg-type]
    assert stand_in.submitted == []


def test_an_arm_without_a_compiler_refuses_what_needs_one() -> None:
    plan = chat_plan(chat(tools=[WEATHER]))
    error = refusal(lambda: start_compile(None, plan))
    assert (error.param, error.code) == ("tools", "structured_outputs_unsupported")
    assert start_compile(None, OutputPlan()) is None
