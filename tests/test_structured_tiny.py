"""The gateway's structured-output and tool paths against a live server over a tiny random
torch model (byte tokenizer, real xgrammar compiler): fast enough for `make test-fast`.

Random weights write nonsense, so whatever comes out valid is the grammar's doing: every
call parses and validates, streamed pieces reassemble to it. tests/test_structured_live.py
runs the same paths with the real default model and the clients apps use.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import TINY, tiny_tokenizer
from backends.upstream import UpstreamConfig
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.local import LocalArm
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from schedulers.base import SchedulerConfig
from tests.conftest import SIM_MODEL, LiveServer, error_of, serve_app, start_server

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": PARAMETERS}}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def tiny() -> Iterator[LiveServer]:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id  # NOTE: LlamaConfig's default (2) is the byte "#" here
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 2048}, eos_token_id=eos)
    model = LlamaForCausalLM(config)
    backend = TorchBackend(model, tokenizer, device="cpu", kv_cache_gb=0.05, block_size=16)
    scheduling = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096)
    with ExitStack() as stack:
        yield start_server(stack, LocalArm.from_backend(backend, config=scheduling))


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    assert name in ("forecast", "clock"), name
    schema = PARAMETERS if name == "forecast" else CLOCK["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def test_required_calls_are_valid_whatever_the_weights(tiny: LiveServer) -> None:
    completion = client_of(tiny).chat.completions.create(
        model=SIM_MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[FORECAST, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        seed=5,
        n=4,
        max_tokens=200,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert calls and len({c.id for c in calls}) == len(calls)
        for call in calls:
            check_call(call.function.name, call.function.arguments)


def test_a_named_tool_and_parallel_false_give_exactly_one_call_of_it(tiny: LiveServer) -> None:
    client = client_of(tiny)
    named = client.chat.completions.create(
        model=SIM_MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[FORECAST, CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        temperature=1.0,
        seed=1,
        n=3,
        max_tokens=200,
    )
    for choice in named.choices:
        assert choice.finish_reason == "stop", choice  # OpenAI's, for a call it was told to make
        [call] = choice.message.tool_calls or []
        assert call.function.name == "forecast"
        check_call(call.function.name, call.function.arguments)
    with client.chat.completions.stream(
        model=SIM_MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[FORECAST, CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "clock"}},
        temperature=1.0,
        seed=3,
        max_tokens=200,
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "stop"
    assert [c.function.name for c in final.message.tool_calls or []] == ["clock"]
    single = client.chat.completions.create(
        model=SIM_MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[FORECAST, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
        n=3,
        max_tokens=200,
    )
    assert all(len(c.message.tool_calls or []) == 1 for c in single.choices)


def test_streamed_calls_reassemble_to_the_whole_answer(tiny: LiveServer) -> None:
    body: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": ASK,
        "tools": [FORECAST, CLOCK],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 9,
        "max_tokens": 200,
    }
    client = client_of(tiny)
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls or []
    with client.chat.completions.stream(**body) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    streamed = final.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    pieces = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    heads = [p for p in pieces if p.id is not None]
    assert [h.index for h in heads] == list(range(len(streamed)))
    assert all(h.function is not None and h.function.arguments == "" for h in heads)


def test_json_schema_and_choice_outputs_are_valid(tiny: LiveServer) -> None:
    client = client_of(tiny)
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": PARAMETERS}}
    completion = client.chat.completions.create(
        model=SIM_MODEL,
        messages=ASK,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=100,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PARAMETERS)
    text = client.completions.create(
        model=SIM_MODEL,
        prompt="x",
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
        n=4,
        temperature=1.0,
        max_tokens=10,
    )
    assert {c.text for c in text.choices} <= {"alpha", "beta"}


def test_responses_stream_a_function_call_and_store_it(tiny: LiveServer) -> None:
    client = client_of(tiny)
    flat = {"type": "function", **FORECAST["function"]}
    events = list(
        client.responses.create(
            model=SIM_MODEL,
            input="Weather?",
            tools=[flat],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "forecast"},
            max_output_tokens=200,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-3]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas  # type: ignore[union-attr]
    check_call("forecast", deltas)
    response = events[-1].response  # type: ignore[union-attr]
    stored = client.responses.retrieve(response.id)
    [item] = stored.output
    assert item.type == "function_call" and item.arguments == deltas  # type: ignore[union-attr]
    follow = client.responses.create(
        model=SIM_MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny"}],  # type: ignore[union-attr]
        text={"format": {"type": "json_schema", "name": "f", "schema": PARAMETERS}},
        max_output_tokens=100,
    )
    assert follow.status == "completed"
    jsonschema.validate(json.loads(follow.output_text), PARAMETERS)


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "description": "d" * 120_000}}}},
         "response_format.json_schema.schema", "grammar_too_large"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "response_format.json_schema.schema", "invalid_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "contains": {"type": "integer"}}}}},
         "response_format.json_schema.schema", "unsupported_grammar_feature"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}},
         "structured_outputs.grammar", "grammar_compile_error"),
        ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex",
         "unsupported_grammar_feature"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", None),
        ({"tools": [FORECAST], "tool_choice": {"type": "function", "function": {"name": "no"}}},
         "tool_choice.function.name", None),
    ],
)  # fmt: skip
def test_bad_grammars_are_400s_before_anything_is_queued(
    tiny: LiveServer, extra: dict[str, Any], param: str, code: str | None
) -> None:
    engine = tiny.arm.engine
    body = {"model": SIM_MODEL, "messages": ASK, "max_tokens": 4, **extra}
    error = error_of(httpx.post(f"{tiny.v1}/chat/completions", json=body, timeout=60), 400)
    assert error["param"] == param, error
    assert error["code"] == code, error
    assert engine.num_waiting == engine.num_running == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_slow_compile_stalls_neither_the_engine_nor_other_requests(tiny: LiveServer) -> None:
    # ~1-3 s to compile, to a grammar of a few KB (so it is handed back at once)
    long_string = {"type": "string", "pattern": "^[a-z0-9]{1,6000}$"}
    slow_format = {"type": "json_schema", "json_schema": {"name": "long", "schema": long_string}}
    plain = {"model": SIM_MODEL, "messages": ASK, "max_tokens": 4}

    async def timed(client: httpx.AsyncClient, body: dict[str, Any], delay_s: float) -> float:
        await asyncio.sleep(delay_s)
        response = await client.post(f"{tiny.v1}/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return time.monotonic()

    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=120) as client:
            slow = timed(client, {**plain, "response_format": slow_format}, 0.0)
            return await asyncio.gather(slow, *(timed(client, plain, 0.2) for _ in range(3)))

    slow_done, *plain_done = asyncio.run(run())
    assert max(plain_done) < slow_done


def test_an_upstream_arm_forwards_tools_and_formats_unchanged_streamed(tiny: LiveServer) -> None:
    config = UpstreamConfig(base_urls=(tiny.v1,), model=SIM_MODEL)
    front = create_app(
        Settings(backend="sim", served_model_name="front"),
        [Deployment("front", [UpstreamArm("tiny", config)])],
    )
    with serve_app(front) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with client.chat.completions.stream(
            model="front",
            messages=ASK,  # type: ignore[arg-type]
            tools=[FORECAST],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
        ) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        [call] = final.message.tool_calls or []
        check_call(call.function.name, call.function.arguments)
        fmt = {"format": {"type": "json_schema", "name": "f", "schema": PARAMETERS}}
        events = list(
            client.responses.create(
                model="front", input="x", text=fmt, max_output_tokens=100, stream=True
            )
        )
        assert events[-1].type == "response.completed"
        jsonschema.validate(json.loads(events[-1].response.output_text), PARAMETERS)  # type: ignore[union-attr]
