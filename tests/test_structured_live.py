"""Structured outputs, tool calls and the Responses API with the real default model
(SmolLM2-135M-Instruct, torch backend), driven by the clients apps run: the OpenAI SDK
(`parse`, tools, streams, `responses`), LangChain's `ChatOpenAI` and the OpenAI Agents SDK.

The constraint is what these tests exercise: a 135M model alone rarely writes valid JSON or
a well-formed call; under the grammar it always does. Budgets are small (CI has 2 cores).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=10**8)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(default_model_url: str) -> str:
    """The session's default-model server (tests/conftest.py)."""
    return f"{default_model_url}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


# -- response_format and structured_outputs ----------------------------------------------


def test_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=40,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed.population >= 0


def test_sampled_outputs_validate_against_the_schema_every_time(client: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
        temperature=1.0,
        seed=7,
        n=2,
        max_tokens=96,  # room for a long sampled name: the test is about the schema
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert (choice.message.content or "").startswith("{")


def test_vllm_structured_outputs_choice_and_regex(client: openai.OpenAI) -> None:
    chosen = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        temperature=1.0,
        seed=1,
        n=2,
        max_tokens=5,
    )
    assert {c.message.content for c in chosen.choices} <= {"yes", "no"}
    phone = client.completions.create(
        model=MODEL,
        prompt="A phone number: ",
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
        temperature=1.0,
        max_tokens=12,
    )
    assert re.fullmatch(r"\d{3}-\d{4}", phone.choices[0].text), phone.choices[0].text
    assert phone.choices[0].finish_reason == "stop"


def test_completions_take_response_format_too(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    completion = client.completions.create(
        model=MODEL,
        prompt="Count to three:",
        extra_body={"response_format": response_format},
        temperature=0,
        max_tokens=20,
    )
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


# -- tools --------------------------------------------------------------------------------


def test_required_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=50,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    [call] = message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    schema = WEATHER_PARAMETERS if call.function.name == "get_weather" else TIME["function"]
    if call.function.name == "get_time":
        schema = schema["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_tool_is_the_one_called(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=40,
    )
    assert completion.choices[0].finish_reason == "stop"  # OpenAI's, for a named function
    [call] = completion.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_auto_returns_a_call_the_model_writes_parsed_never_raw(client: openai.OpenAI) -> None:
    """Under `auto` the model chooses; SmolLM2 rarely calls on its own, so the prompt shows
    it the call to write: it comes back as `tool_calls`, not as content."""
    example = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    )
    prompt = f"Reply with exactly this and nothing else:\n{example}\n</tool_call>"
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_tokens=50,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_streamed_tool_calls_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 50,
    }
    whole = client.chat.completions.create(**body).choices[0].message
    with client.chat.completions.stream(**body) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    [streamed] = final.message.tool_calls or []
    [expected] = whole.tool_calls or []
    assert streamed.function.name == expected.function.name == "get_weather"
    assert streamed.function.arguments == expected.function.arguments
    pieces = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    head = pieces[0][0]
    assert head.id and head.function is not None and head.function.name == "get_weather"
    assert len(pieces) > 2 and all(p[0].id is None for p in pieces[1:])
    assert all(c.choices[0].delta.content in (None, "") for c in chunks)


def test_the_tool_history_is_rendered_and_answered(client: openai.OpenAI) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages: list[Any] = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    bare = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=1)
    assert completion.usage is not None and bare.usage is not None
    # the call (name and arguments) and its result are in the prompt
    assert completion.usage.prompt_tokens > bare.usage.prompt_tokens + 25


# -- the Responses API --------------------------------------------------------------------

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_stream_a_call_then_answer_its_output_chained(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="Use the tools.",
        tools=[FLAT_WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=50,
    ) as stream:
        events = list(stream)
        first = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.index("response.function_call_arguments.delta") < kinds.index(
        "response.function_call_arguments.done"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=output,  # type: ignore[arg-type]
        tools=[FLAT_WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=8,
    )
    assert second.output_text and second.previous_response_id == first.id
    # without the stored conversation, the output answers no call
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=output, max_output_tokens=8)  # type: ignore[arg-type]
    assert info.value.param == "input[0].call_id"


def test_responses_text_format_streamed_and_parsed_by_the_sdk(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input="Describe Rome as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=40,
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, City)
    again = client.responses.parse(
        model=MODEL,
        input="Describe Rome as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=40,
    )
    assert isinstance(again.output_parsed, City)
    assert again.usage is not None and again.usage.output_tokens <= 40


# -- LangChain and the OpenAI Agents SDK ----------------------------------------------------


def test_langchain_structured_output_and_bound_tools(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=40,
        max_retries=0,
    )  # fmt: skip
    city = llm.with_structured_output(City).invoke("Describe Paris as JSON.")
    assert isinstance(city, City)

    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city; unit is celsius or fahrenheit."""
        return "Sunny."

    bound = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    message = bound.invoke("What is the weather in Paris?")
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert call["id"].startswith("call_")
    on_responses = ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=5,
        max_retries=0, use_responses_api=True,
    )  # fmt: skip
    reply = on_responses.invoke("Say hi.")
    assert reply.text and reply.response_metadata["status"] == "incomplete"  # 5 tokens


def test_an_agents_sdk_agent_calls_its_tool_on_the_responses_api(base_url: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_client(openai.AsyncOpenAI(base_url=base_url, api_key="unused"))
    cities: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny, 24 degrees."

    agent = Agent(
        name="weather",
        instructions="Answer with the tools.",
        tools=[get_weather],
        model=MODEL,  # the SDK's default model class: OpenAIResponsesModel
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=50
        ),
        # NOTE: a 135M model's prose answer after the tool would run to max_tokens
        # (`response.incomplete`, which the SDK raises on): the tool's output is the answer
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(cities) == 1 and cities[0]
    assert result.final_output == "Sunny, 24 degrees."


# -- bad input, with a real compiler --------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
            "response_format.json_schema.schema",
            "invalid_grammar",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
            "response_format.json_schema.schema",
            "unsupported_grammar_feature",
        ),
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", None),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar", None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name", None),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name", None),
    ],
)  # fmt: skip
def test_bad_grammars_are_400s_naming_the_param(
    base_url: str, extra: dict[str, Any], param: str, code: str | None
) -> None:
    import httpx

    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 5, **extra}
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
