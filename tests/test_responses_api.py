"""The Responses API pieces, checked against the real `openai` SDK's types and stream reader.

No engine here: outputs are fed by hand (as the engine's text deltas would be), so these
tests pin the wire shapes; the live endpoint is wired on main.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.api.outputs.tool_parser import ToolCallDelta, ToolCallStreamParser
from gateway.api.outputs.tools import check_tools, resolve_tool_choice
from gateway.api.problems import ParamProblem
from gateway.api.responses.convert import (
    ChatParts,
    conversation_after,
    response_skeleton,
    to_chat,
)
from gateway.api.responses.events import ResponseBuilder
from gateway.api.responses.protocol import (
    ResponsesRequest,
    ResponseUsage,
    deleted_body,
    to_sse,
    unsupported,
)
from gateway.api.responses.store import (
    MemoryResponseStore,
    ResponseOwner,
    previous_conversation,
)
from gateway.http.sse import event_type
from schedulers.structured_output import GrammarSpec
from tests.conftest import serve_app

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **body})


def chat(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> ChatParts:
    parts = to_chat(req, history or [])
    assert isinstance(parts, ChatParts), parts
    return parts


def problem_of(result: object) -> ParamProblem:
    assert isinstance(result, ParamProblem), result
    return result


def generate(
    req: ResponsesRequest, chunks: list[str], finish_reason: str = "stop"
) -> tuple[ResponseBuilder, list[Any]]:
    """Run `chunks` of generated text through the parser and the builder, as serving would."""
    builder = ResponseBuilder(response_skeleton(req, "m"))
    counter = itertools.count()
    parser = ToolCallStreamParser(lambda: f"call_{next(counter)}")
    events = builder.start()
    for chunk in chunks:
        events += builder.feed(parser.feed(chunk))
    events += builder.feed(parser.finish())
    events += builder.finish(ResponseUsage.of(7, len(chunks)), finish_reason)
    return builder, events


# -- the request -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("reasoning", {"effort": "high"}, "reasoning"),
        ("background", True, "background"),
        ("include", ["file_search_call.results"], "include"),
        ("truncation", "auto", "truncation"),
        ("conversation", "conv_1", "conversation"),
        ("tools", [WEATHER, {"type": "web_search"}], "tools[1].type"),
        ("tools", [{"type": "file_search", "vector_store_ids": ["v"]}], "tools[0].type"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_param(field: str, value: Any, param: str) -> None:
    problem = problem_of(unsupported(request(**{field: value})))
    assert problem.param == param and problem.status == 400
    assert (
        unsupported(request(reasoning={"effort": None}, include=[], truncation="disabled")) is None
    )


def test_a_string_input_and_instructions_become_chat_messages() -> None:
    parts = chat(request(instructions="Be brief.", input="Hello"))
    assert parts.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert parts.answer is None and parts.tools == [] and parts.parallel_tool_calls


def test_input_items_with_calls_and_their_outputs_become_chat_history() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    parts = chat(request(input=items, tools=[WEATHER], tool_choice="auto"))
    assert parts.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    tools = check_tools(parts.tools)
    assert not isinstance(tools, ParamProblem) and tools[0].name == "get_weather"


def test_the_tool_choice_and_text_format_shapes_convert() -> None:
    named = chat(request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}))
    tools = check_tools(named.tools)
    assert not isinstance(tools, ParamProblem)
    resolved = resolve_tool_choice(named.tool_choice, tools)
    assert not isinstance(resolved, ParamProblem) and resolved.forced
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}
    assert chat(request(text=fmt)).answer == GrammarSpec.json_schema(schema)
    assert chat(request(parallel_tool_calls=False)).parallel_tool_calls is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                  {"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[1].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments"),
        ({"input": []}, "input"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ],
)  # fmt: skip
def test_bad_input_names_the_responses_param(body: dict[str, Any], param: str) -> None:
    assert problem_of(to_chat(request(**body))).param == param


# -- the response object and its stream ----------------------------------------------------


def test_a_text_answer_validates_as_the_sdks_response() -> None:
    req = request(instructions="Be brief.", temperature=0.5)
    builder, _ = generate(req, ["Hello", " there", "!"])
    body = builder.response.model_dump(mode="json")
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Hello there!" == builder.response.output_text
    assert parsed.status == "completed" and parsed.id.startswith("resp_")
    assert parsed.output[0].id.startswith("msg_")  # type: ignore[union-attr]
    assert parsed.usage is not None and parsed.usage.total_tokens == 10
    assert parsed.instructions == "Be brief." and parsed.temperature == 0.5


def test_tool_calls_become_function_call_items() -> None:
    builder, _ = generate(request(tools=[WEATHER]), ["Let me check. ", CALL_TEXT])
    parsed = Response.model_validate(builder.response.model_dump(mode="json"))
    message, call = parsed.output
    assert message.type == "message" and parsed.output_text == "Let me check."
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_0",
        "get_weather",
        {"city": "Paris"},
    )


def test_a_cut_answer_is_incomplete_for_max_output_tokens() -> None:
    builder, events = generate(request(max_output_tokens=3), ["a", "b", "c"], "length")
    parsed = Response.model_validate(builder.response.model_dump(mode="json"))
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.incomplete"


def sdk_final(events: list[Any]) -> Response:
    """Feed our events, as the SDK's own stream reader sees them, into its accumulator."""
    state: ResponseStreamState[Any] = ResponseStreamState(
        input_tools=openai.omit, text_format=openai.omit
    )
    final = None
    for event in events:
        for out in state.handle_event(EVENTS.validate_python(event.model_dump(mode="json"))):
            if out.type == "response.completed":
                final = out.response
    assert final is not None, "no response.completed"
    return final


def without_parsed(value: Any) -> Any:
    """A dump without the SDK's client-side `parsed` / `parsed_arguments` additions."""
    if isinstance(value, dict):
        return {k: without_parsed(v) for k, v in value.items() if k not in _PARSED}
    if isinstance(value, list):
        return [without_parsed(v) for v in value]
    return value


_PARSED = ("parsed", "parsed_arguments")


@pytest.mark.parametrize(
    "chunks",
    [
        ["Hel", "lo", " world"],
        ["<tool", "_call>\n{\"name\": \"get_weather\", \"argu", 'ments": {"ci', 'ty": "Rome"}}',
         "\n</tool_call>"],
        ["Checking.", " ", CALL_TEXT, "\n", CALL_TEXT.replace("Paris", "Oslo"), " Done."],
    ],
)  # fmt: skip
def test_stream_events_are_the_sdks_types_in_order_and_rebuild_the_same_response(
    chunks: list[str],
) -> None:
    req = request(tools=[WEATHER])
    builder, events = generate(req, chunks)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for i, kind in enumerate(kinds):  # each item opens before its deltas and closes after
        if kind == "response.output_text.delta":
            assert "response.content_part.added" in kinds[:i]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    final = sdk_final(events)
    ours = Response.model_validate(builder.response.model_dump(mode="json"))
    assert without_parsed(final.model_dump()) == ours.model_dump()
    assert all(item.status == "completed" for item in ours.output)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    calls = [i for i in builder.response.output if i.type == "function_call"]
    assert deltas == "".join(c.arguments for c in calls)


def test_every_events_type_is_read_off_its_json_as_parsing_reads_it() -> None:
    """The framer reads a typed event's `type` off the string (streaming.event_type); every
    event the builder emits, and payloads of other shapes, give what parsing gives."""
    _, events = generate(request(tools=[WEATHER]), ["Checking. ", CALL_TEXT, " Done."])
    failed = ResponseBuilder(response_skeleton(request(), "m"))
    events += failed.start() + failed.feed(["partial"]) + failed.fail("stopped")
    kinds = {e.type for e in events}
    assert {"response.output_text.delta", "response.function_call_arguments.done",
            "response.failed", "response.completed"} <= kinds  # fmt: skip
    for event in events:
        payload = event.model_dump_json()
        assert event_type(payload) == event.type == json.loads(payload)["type"]
    others = [
        '{"type":"x"}',
        '{"sequence_number":"7","type":"y"}',
        '{"sequence_number":3}',
        '{"sequence_number":1,"item":{"type":"inner"},"type":"outer"}',
        '{"sequence_number":[{"n":1,"type":"inner"}],"type":"outer"}',
        '{"sequence_number":2,"type":"a\\"b"}',
        '{"sequence_number": 4, "type": "z"}',
    ]
    for payload in others:
        assert event_type(payload) == json.loads(payload).get("type", "message")


def test_text_after_a_call_is_a_message_of_its_own_text() -> None:
    """Each message item holds only its own deltas, in its done event and in the response."""
    builder = ResponseBuilder(response_skeleton(request(), "m"))
    events = builder.start() + builder.feed(["Let me", " check."])
    events += builder.feed([ToolCallDelta(0, "call_0", "get_weather"), ToolCallDelta(0, None,
                            None, '{"city": "Paris"}')])  # fmt: skip
    events += builder.feed(["It is", " sunny."]) + builder.finish(ResponseUsage.of(7, 4))
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert done == ["Let me check.", "It is sunny."]
    first, call, second = builder.response.output
    assert [first.content[0].text, second.content[0].text] == done  # type: ignore[union-attr]
    assert call.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]


def test_a_failed_stream_ends_with_response_failed() -> None:
    builder = ResponseBuilder(response_skeleton(request(), "m"))
    events = builder.start() + builder.feed(["partial"]) + builder.fail("the engine stopped")
    assert events[-1].type == "response.failed"
    parsed = EVENTS.validate_python(events[-1].model_dump(mode="json"))
    assert parsed.response.error is not None  # type: ignore[union-attr]
    assert parsed.response.error.message == "the engine stopped"  # type: ignore[union-attr]


def test_the_real_sdk_reads_our_sse_stream_and_bodies_over_http() -> None:
    """A stand-in endpoint serving canned output through our builder and `to_sse`: the SDK's
    `responses.create(stream=True)`, `responses.stream()`, `retrieve` and `delete` work."""
    store = MemoryResponseStore()
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/responses")
    async def create(body: dict[str, Any]) -> Any:
        req = ResponsesRequest.model_validate(body)
        builder, events = generate(req, ["Hello", " from", " Carousel"])
        await store.put(builder.response.id, builder.response.model_dump(mode="json"), [])
        if not req.stream:
            return JSONResponse(builder.response.model_dump(mode="json"))

        async def sse() -> AsyncIterator[str]:
            for event in events:
                yield to_sse(event)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        entry = await store.get(response_id)
        return JSONResponse(entry.response if entry else {"error": {}}, 200 if entry else 404)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        await store.delete(response_id)
        return JSONResponse(deleted_body(response_id))

    with serve_app(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        types = [e.type for e in client.responses.create(model="m", input="Hi", stream=True)]
        assert types[0] == "response.created" and types[-1] == "response.completed"
        with client.responses.stream(model="m", input="Hi") as stream:
            final = stream.get_final_response()
        assert final.output_text == "Hello from Carousel"
        plain = client.responses.create(model="m", input="Hi")
        assert plain.output_text == "Hello from Carousel"
        assert client.responses.retrieve(plain.id).id == plain.id
        client.responses.delete(plain.id)
        assert asyncio.run(store.get(plain.id)) is None


# -- previous_response_id and the store --------------------------------------------------


async def test_a_follow_up_continues_the_stored_conversation_without_old_instructions() -> None:
    store = MemoryResponseStore()
    first_req = request(instructions="Speak French.", input="Hi", tools=[WEATHER])
    first_parts = chat(first_req)
    builder, _ = generate(first_req, [CALL_TEXT])
    conversation = conversation_after([], first_parts.input_items, builder.response)
    await store.put(builder.response.id, builder.response.model_dump(mode="json"), conversation)
    history = await previous_conversation(store, builder.response.id)
    assert not isinstance(history, ParamProblem)
    follow = request(
        previous_response_id=builder.response.id,
        input=[{"type": "function_call_output", "call_id": "call_0", "output": "sunny"}],
    )
    parts = chat(follow, history)
    assert [m["role"] for m in parts.messages] == ["user", "assistant", "tool"]
    assert parts.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    missing = await previous_conversation(store, "resp_unknown")
    assert isinstance(missing, ParamProblem) and missing.status == 404
    assert missing.param == "previous_response_id"
    assert await previous_conversation(store, None) == []
    other = await previous_conversation(store, builder.response.id, "someone-else")
    assert isinstance(other, ParamProblem) and other.status == 404


async def test_the_store_keeps_the_most_recently_used_within_its_bounds() -> None:
    store = MemoryResponseStore(max_responses=2)
    await store.put("a", {"n": 1}, [])
    await store.put("b", {"n": 2}, [])
    assert await store.get("a") is not None  # a is now the most recent
    await store.put("c", {"n": 3}, [])
    assert await store.get("b") is None and await store.get("a") is not None
    assert len(store) == 2
    assert await store.delete("a") and not await store.delete("a")
    small = MemoryResponseStore(max_bytes=100)
    assert not await small.put("big", {"text": "x" * 200}, [])
    for name in "defgh":
        assert await small.put(name, {"text": "y" * 20}, [])
    assert small.size_bytes <= 100
    assert await small.get("h") is not None and await small.get("d") is None
    with pytest.raises(ValueError):
        MemoryResponseStore(max_responses=0)


async def test_the_store_remembers_which_arm_created_an_id_within_its_bound() -> None:
    store = MemoryResponseStore(max_responses=2)
    await store.remember_owner("a", "front", "remote")
    await store.remember_owner("b", "front", "here")
    assert await store.owner("a") == ResponseOwner("front", "remote")  # a is now the most recent
    await store.remember_owner("c", "front", "remote")
    assert await store.owner("b") is None and await store.owner("a") is not None
    owner = await store.owner("c")
    assert owner is not None and owner.key == ("front", "remote")
    await store.forget_owner("a")
    assert await store.owner("a") is None
    assert len(store) == 0  # noting owners stores no responses
