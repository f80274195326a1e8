"""Schemathesis against the app's own OpenAPI schema: no 5xx, and every error OpenAI-shaped.

The routes read their bodies by hand, so `app.openapi()` has no request bodies for the two
OpenAI endpoints; the test adds them from the pydantic request models
(gateway/api/protocol.py). Both positive (schema-valid) and negative (schema-violating,
including non-JSON) cases are sent to a live loopback server over the simulator. Bounded: at
most 100 examples per operation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis import GenerationMode

from gateway.api.pipeline import ServingOptions
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, LiveServer, sim_arm, start_server

_TOKEN = {"type": "integer", "minimum": 0, "maximum": 257}  # the simulator's vocabulary

#: bounds that keep one generated request cheap (the limits themselves are tested elsewhere)
_CHEAP = {
    "model": {"const": SIM_MODEL},
    "n": {"type": "integer", "minimum": 1, "maximum": 3},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 24},
    "stop_token_ids": {"type": ["array", "null"], "items": _TOKEN, "maxItems": 4},
    "logit_bias": {
        "type": ["object", "null"],
        "propertyNames": {"pattern": "^(0|[1-9][0-9]?)$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": 4,
    },
}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string", "maxLength": 100}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "additionalProperties": False,
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {
            "anyOf": [
                {"type": "string", "maxLength": 200},
                {"type": "array", "items": _TEXT_PART, "maxItems": 3},
            ]
        },
        "name": {"type": "string", "maxLength": 20},
    },
}
_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": 200},
        {"type": "array", "items": _TOKEN, "minItems": 1, "maxItems": 40},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 50},
            "minItems": 1,
            "maxItems": 4,
        },
        {
            "type": "array",
            "items": {"type": "array", "items": _TOKEN, "minItems": 1, "maxItems": 20},
            "minItems": 1,
            "maxItems": 4,
        },
    ]
}
#: what each endpoint serves: its model's schema, narrowed to what the server implements
#: (positive cases should mostly reach the engine; negative cases break these rules)
_BODIES: dict[str, tuple[type[BaseModel], dict[str, Any], set[str]]] = {
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 4},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 24},
        },
        {"tools", "tool_choice", "functions", "function_call", "response_format", "audio"}
        | {"modalities", "prediction", "web_search_options"},
    ),
    "/v1/completions": (CompletionRequest, {"prompt": _PROMPT}, {"suffix", "best_of"}),
}


def openapi_with_bodies() -> dict[str, Any]:
    """The app's schema, with the chat and completions request bodies filled in."""
    raw = create_app(Settings(backend="sim")).openapi()
    components = raw.setdefault("components", {}).setdefault("schemas", {})
    for path, (model, narrowed, unserved) in _BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        properties = body["properties"]
        for name in unserved | {"stream_options", "skip_special_tokens"}:
            del properties[name]
        properties.update(_CHEAP | narrowed)
        body["additionalProperties"] = False
        components[model.__name__] = body
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        raw["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    return raw


SCHEMA = schemathesis.openapi.from_dict(openapi_with_bodies())
OPERATIONS = [
    (path, method.upper())
    for path, operations in SCHEMA.raw_schema["paths"].items()
    for method in operations
]


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LiveServer]:
    options = ServingOptions(default_max_tokens=8, max_waiting_requests=64)
    with ExitStack() as stack:
        yield start_server(stack, sim_arm(options=options, max_num_seqs=16))


def assert_openai_error(error: Any) -> None:
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def check_response(status: int, content_type: str, text: str) -> None:
    assert status < 500, text[:500]
    if status >= 400:
        body = json.loads(text)
        assert set(body) == {"error"}, text[:500]
        assert_openai_error(body["error"])
        return
    if not content_type.startswith("text/event-stream"):
        return
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    for event in text.split("\n\n")[:-2]:
        payload = json.loads(event.removeprefix("data: "))
        if "error" in payload:  # in-band: an error after the 200, never a server error
            assert_openai_error(payload["error"])
            assert payload["error"]["type"] != "server_error", payload


@pytest.mark.parametrize(("path", "method"), OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_fuzzed_requests_never_5xx_and_errors_are_openai_shaped(
    fuzz_server: LiveServer, path: str, method: str
) -> None:
    operation = SCHEMA[path][method]
    spec = SCHEMA.raw_schema["paths"][path][method.lower()]
    cases = operation.as_strategy(GenerationMode.POSITIVE)
    if "requestBody" in spec or spec.get("parameters"):
        cases = st.one_of(cases, operation.as_strategy(GenerationMode.NEGATIVE))
    examples = 100 if method == "POST" else 25

    @given(case=cases)
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def fuzz(case: schemathesis.Case) -> None:
        # NOTE: sent with requests directly: case.call() cuts long event streams short
        kwargs = case.as_transport_kwargs(base_url=fuzz_server.url)
        response = requests.request(**kwargs, timeout=30)
        content_type = response.headers.get("content-type", "")
        check_response(response.status_code, content_type, response.text)

    fuzz()
    engine = fuzz_server.arm.engine
    assert engine.is_alive
    blocks = engine.block_manager
    assert engine.num_running == 0 and blocks.num_free_blocks == blocks.num_blocks
