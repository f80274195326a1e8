"""Schema work cannot freeze the gateway: tool and answer schemas are checked off the event
loop, in linear time, under a time and size budget (docs/reliability.md, "Schema work and
secrets").

The bombs are request shapes a key holder can send within the body limit: `oneOf`s of
~1,400 object branches told apart by a required property's `const`, which a pairwise
overlap check compares ~1M times (seconds per schema, held on the event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from gateway.api.outputs import plan as output_plan
from schedulers.structured_output.schema_support import json_schema_problem
from tests.conftest import CHAT, LiveServer, error_of, start_server


def one_of_bomb(branches: int) -> dict[str, Any]:
    """An object whose one property is a `oneOf` of `branches` discriminated objects."""
    one_of = [
        {"type": "object", "required": ["k"], "properties": {"k": {"const": i}}}
        for i in range(branches)
    ]
    return {"type": "object", "properties": {"v": {"oneOf": one_of}}}


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


#: a dozen tools, each a ~45 KB `oneOf` of 700 branches
TOOLS_BOMB = {
    **CHAT,
    "tools": [tool(f"t{i}", one_of_bomb(700)) for i in range(12)],
}
#: one small tool beside a ~95 KB answer schema (checked with the tools' grammar)
ANSWER_BOMB = {
    **CHAT,
    "tools": [tool("lookup", {"type": "object", "properties": {"q": {"type": "string"}}})],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": one_of_bomb(1400)},
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with ExitStack() as stack:
        yield start_server(stack)


def answers_while_in_flight(server: LiveServer, bomb: dict[str, Any]) -> httpx.Response:
    """Send `bomb`; while it is in flight, /health and a plain chat each answer within 1 s.
    Returns the bomb's own response."""
    replies: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: replies.append(
            httpx.post(f"{server.v1}/chat/completions", json=bomb, timeout=120)
        )
    )
    sender.start()
    time.sleep(0.1)  # the body is parsed; its schemas are being checked
    with httpx.Client(timeout=30) as client:
        start = time.monotonic()
        assert client.get(f"{server.url}/health").status_code == 200
        health_s = time.monotonic() - start
        start = time.monotonic()
        plain = client.post(f"{server.v1}/chat/completions", json=CHAT)
        chat_s = time.monotonic() - start
    sender.join(120)
    assert plain.status_code == 200, plain.text
    assert health_s < 1.0 and chat_s < 1.0, (health_s, chat_s)
    return replies[0]


def test_health_and_plain_chat_answer_while_a_tools_schema_bomb_is_checked(
    server: LiveServer,
) -> None:
    reply = answers_while_in_flight(server, TOOLS_BOMB)
    error = error_of(reply, 400)  # a dozen 45 KB schemas: over the tools' size budget
    assert error["code"] == "grammar_too_large"
    assert error["param"].startswith("tools[")


def test_health_and_plain_chat_answer_while_an_answer_schema_bomb_is_checked(
    server: LiveServer,
) -> None:
    reply = answers_while_in_flight(server, ANSWER_BOMB)
    # valid and checked in time: the sim arm then says it cannot constrain outputs
    assert error_of(reply, 400)["code"] == "structured_outputs_unsupported"


def test_schema_work_past_its_time_budget_is_a_400_naming_it(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_plan, "SCHEMA_CHECK_BUDGET_S", 0.01)
    body = {**CHAT, "tools": [tool("big", one_of_bomb(1400))]}
    start = time.monotonic()
    reply = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    error = error_of(reply, 400)
    assert error["code"] == "schema_too_complex"
    assert "0.01 s" in error["message"]
    assert time.monotonic() - start < 5


def test_a_large_one_of_is_checked_in_linear_time_and_still_refuses_overlaps() -> None:
    bomb = one_of_bomb(1400)
    start = time.monotonic()
    assert json_schema_problem(bomb) is None
    assert time.monotonic() - start < 2.0  # pair by pair: ~1M comparisons, 7+ s
    overlapping = one_of_bomb(1400)
    overlapping["properties"]["v"]["oneOf"][1399]["properties"]["k"]["const"] = 3
    problem = json_schema_problem(overlapping)
    assert problem is not None and "'oneOf'" in problem[1]
    untyped = {"oneOf": [{"const": i} for i in range(1400)] + [{"enum": [5, "x"]}]}
    problem = json_schema_problem(untyped)
    assert problem is not None and "'oneOf'" in problem[1]


@pytest.mark.parametrize(
    ("branches", "disjoint"),
    [
        ([{"type": "string"}, {"type": "integer"}, {"type": "null"}], True),
        ([{"type": "integer"}, {"type": "number"}], False),
        ([{"type": "string"}, {"const": 1}], False),
        ([{"type": "string", "enum": ["a", "b"]}, {"type": "string", "const": "c"}], True),
        ([{"const": 1}, {"const": 1.0}], False),
        ([{"const": True}, {"const": 1}], True),
        # a pair told apart by type, another by a const: compared pair by pair (small list)
        ([{"type": "string", "const": "a"}, {"type": ["string", "null"], "enum": ["b", None]}],
         True),
    ],
)  # fmt: skip
def test_one_of_branches_are_disjoint_by_type_const_or_discriminator(
    branches: list[dict[str, Any]], disjoint: bool
) -> None:
    problem = json_schema_problem({"oneOf": branches})
    assert (problem is None) is disjoint, problem
