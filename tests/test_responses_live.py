"""POST/GET/DELETE /v1/responses on a live server with the real `openai` SDK (simulator arm:
these tests pin the wire and the store, not what the text says; tests/test_structured_live.py
runs the real model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from backends.upstream import UpstreamConfig
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, LiveServer, error_of, serve_app, sim_arm

EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",
]

IMAGE = {"type": "input_image", "image_url": "http://x"}
NOT_ENFORCEABLE = {"type": "object", "not": {"required": ["a"]}}


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)


def test_create_returns_a_response_with_usage_and_stores_it(server: LiveServer) -> None:
    client = client_of(server)
    response = client.responses.create(model=SIM_MODEL, input="Hello", max_output_tokens=3)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # the simulator never stops before the limit
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.usage.total_tokens == response.usage.input_tokens + 3
    assert response.output_text == response.output[0].content[0].text  # type: ignore[union-attr]
    stored = client.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false_keeps_nothing(server: LiveServer) -> None:
    client = client_of(server)
    response = client.responses.create(
        model=SIM_MODEL, input="Hello", max_output_tokens=1, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_stream_has_the_typed_events_in_order_and_rebuilds_the_response(
    server: LiveServer,
) -> None:
    client = client_of(server)
    events = list(
        client.responses.create(model=SIM_MODEL, input="Hello", max_output_tokens=4, stream=True)
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert 1 <= deltas <= 4
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == EVENT_ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens == 4
    assert client.responses.retrieve(final.id).output_text == text


def test_the_raw_stream_is_event_lines_without_done(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    raw = httpx.post(f"{server.v1}/responses", json=body).text
    frames = [f for f in raw.split("\n\n") if f]
    assert "[DONE]" not in raw
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")


def test_previous_response_id_continues_the_conversation(
    make_server: Callable[..., LiveServer],
) -> None:
    server = make_server(sim_arm(), log_prompts=True)
    client = client_of(server)
    first = client.responses.create(
        model=SIM_MODEL, input="My name is Ada.", instructions="Be brief.", max_output_tokens=2
    )
    second = client.responses.create(
        model=SIM_MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=2,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # the first turn (its input and output) is in the second prompt; its instructions are not
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(
            model=SIM_MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=1
        )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_the_store_size_is_a_setting(make_server: Callable[..., LiveServer]) -> None:
    server = make_server(sim_arm(), responses_store_size=2)
    client = client_of(server)
    ids = [
        client.responses.create(model=SIM_MODEL, input="x", max_output_tokens=1).id
        for _ in range(3)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[2]).id == ids[2]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {"input": [{"type": "message", "role": "user", "content": [IMAGE]}]},
            "input[0].content[0].type",
        ),  # fmt: skip
        (
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
            "input[0].call_id",
        ),  # fmt: skip
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
            "text.format.name",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": NOT_ENFORCEABLE}]},
            "tools[0].parameters",
        ),  # fmt: skip
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),  # fmt: skip
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_param_before_anything_runs(
    server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    before = server.arm.engine.num_waiting + server.arm.engine.num_running
    body = {"model": SIM_MODEL, "input": "Hi", "max_output_tokens": 1, **extra}
    error = error_of(httpx.post(f"{server.v1}/responses", json=body), 400)
    assert error["param"] == param, error
    assert server.arm.engine.num_waiting + server.arm.engine.num_running == before


def test_unknown_ids_are_404s(server: LiveServer) -> None:
    error = error_of(httpx.get(f"{server.v1}/responses/resp_nope"), 404)
    assert error["param"] == "response_id"
    error_of(httpx.delete(f"{server.v1}/responses/resp_nope"), 404)


def test_an_upstream_arm_forwards_responses_streamed_and_not(
    make_server: Callable[..., LiveServer],
) -> None:
    remote = make_server(sim_arm())
    config = UpstreamConfig(base_urls=(remote.v1,), model=SIM_MODEL)
    front = create_app(
        Settings(backend="sim", served_model_name="front"),
        [Deployment("front", [UpstreamArm("remote", config)])],
    )
    with serve_app(front) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        whole = client.responses.create(model="front", input="Hi", max_output_tokens=3)
        assert whole.model == "front" and whole.usage is not None
        assert whole.usage.output_tokens == 3
        # the remote stored it: the id is the remote's
        assert client_of(remote).responses.retrieve(whole.id).output_text == whole.output_text
        events = list(
            client.responses.create(model="front", input="Hi", max_output_tokens=3, stream=True)
        )
        kinds = [e.type for e in events]
        assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == EVENT_ORDER
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].response.model == "front"  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="front", input="Hi", reasoning={"effort": "low"})
        assert info.value.body["param"] == "reasoning"  # type: ignore[index]
