"""Every error is OpenAI-shaped, with the right status, type, param and code."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.arms.local import LocalArm
from tests.conftest import CHAT, SIM_MODEL, LiveServer, LoopKiller, error_of, sim_arm, sse_payloads

HELLO = CHAT["messages"]


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_malformed_json_is_400_not_422(server: LiveServer) -> None:
    response = httpx.post(
        f"{server.v1}/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


def test_non_object_body_is_400(server: LiveServer) -> None:
    error = error_of(httpx.post(f"{server.v1}/completions", json=[1, 2]), 400)
    assert "JSON object" in error["message"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"n": "two"}, "n"),
        ({"stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
        ({"logprobs": "yes please"}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"model": None}, "model"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"seed": "abc"}, "seed"),
    ],
)
def test_wrong_types_and_values_name_the_param(
    server: LiveServer, patch: dict[str, object], param: str
) -> None:
    response = httpx.post(f"{server.v1}/chat/completions", json={**CHAT, **patch})
    error = error_of(response, 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert "detail" not in response.text


def test_missing_required_field_is_named(server: LiveServer) -> None:
    error = error_of(httpx.post(f"{server.v1}/chat/completions", json={"model": SIM_MODEL}), 400)
    assert error["param"] == "messages" and "messages" in error["message"]


def test_prompt_plus_max_tokens_beyond_context_is_context_length_exceeded(
    server: LiveServer,
) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SIM_MODEL, prompt="a" * 1000, max_tokens=100)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    assert "1024" in info.value.message and "1100" in info.value.message


def test_prompt_alone_beyond_context_is_context_length_exceeded(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "a" * 1100}]}
    error = error_of(httpx.post(f"{server.v1}/chat/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_request_bigger_than_the_whole_kv_cache_is_refused_by_the_engine(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(sim_arm(num_blocks=4))  # 64 token slots, 1024-token context
    body = {"model": SIM_MODEL, "prompt": "a" * 50, "max_tokens": 30}
    error = error_of(httpx.post(f"{srv.v1}/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded"
    assert "KV cache" in error["message"]


def test_unknown_model_is_404_model_not_found(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert info.value.code == "model_not_found"
    error = error_of(httpx.get(f"{server.v1}/models/gpt-17"), 404)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"


def test_unknown_route_and_wrong_method_are_openai_shaped(server: LiveServer) -> None:
    assert error_of(httpx.post(f"{server.v1}/embeddings", json={}), 404)["code"] == "unknown_url"
    assert error_of(httpx.get(f"{server.v1}/chat/completions"), 405)["code"] == (
        "method_not_allowed"
    )


def test_api_keys_are_required_on_v1_when_configured(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(api_keys=["key-one", "key-two"])
    missing = error_of(httpx.post(f"{srv.v1}/chat/completions", json=CHAT), 401)
    assert missing["type"] == "authentication_error" and missing["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=srv.v1, api_key="key-three", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.code == "invalid_api_key"
    assert "key-three" not in info.value.message
    right = openai.OpenAI(base_url=srv.v1, api_key="key-two", max_retries=0)
    assert right.chat.completions.create(**CHAT).choices
    assert httpx.get(f"{srv.url}/health").status_code == 200  # stays open


def test_oversized_body_is_413_by_length_and_while_streamed(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(max_body_bytes=2000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    by_length = httpx.post(f"{srv.v1}/chat/completions", json=big)
    assert error_of(by_length, 413)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    streamed = httpx.post(f"{srv.v1}/chat/completions", content=chunked())
    assert error_of(streamed, 413)["code"] == "request_too_large"
    assert httpx.post(f"{srv.v1}/chat/completions", json=CHAT).status_code == 200


def test_full_waiting_queue_is_429_with_retry_after(
    make_server: Callable[..., LiveServer],
) -> None:
    options = ServingOptions(max_waiting_requests=1, retry_after_s=3)
    srv = make_server(sim_arm(time_scale=1.0, max_num_seqs=1, options=options))
    engine = srv.arm.engine
    long = {**CHAT, "max_tokens": 900, "stream": True}
    url = f"{srv.v1}/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=long) as running:
        assert running.status_code == 200
        wait_until(lambda: engine.num_running == 1)
        with http.stream("POST", url, json=long) as waiting:
            assert waiting.status_code == 200
            wait_until(lambda: engine.num_waiting == 1)
            refused = http.post(url, json=CHAT)
            error = error_of(refused, 429)
            assert error["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "3"
    wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)


def test_dead_engine_loop_gives_503_and_unhealthy(make_server: Callable[..., LiveServer]) -> None:
    srv = make_server()
    backend = srv.arm.engine.backend
    assert isinstance(backend, SimBackend)
    backend.fail_next = LoopKiller()
    in_flight = httpx.post(f"{srv.v1}/chat/completions", json=CHAT)
    assert error_of(in_flight, 503)["code"] == "engine_dead"
    after = httpx.post(f"{srv.v1}/chat/completions", json=CHAT)
    assert error_of(after, 503)["type"] == "server_error"
    assert after.headers["retry-after"] == "1"
    health = httpx.get(f"{srv.url}/health")
    assert error_of(health, 503)["code"] == "engine_dead"


def test_engine_death_mid_stream_is_reported_in_band(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server()
    backend = srv.arm.engine.backend
    assert isinstance(backend, SimBackend)
    backend.fail_next = LoopKiller()
    response = httpx.post(f"{srv.v1}/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    payloads = [json.loads(p) for p in sse_payloads(response.text)]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert set(payloads[-1]) == {"error"}
    assert payloads[-1]["error"]["code"] == "engine_dead"


def test_failed_step_is_500_and_the_engine_keeps_serving(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server()
    backend = srv.arm.engine.backend
    assert isinstance(backend, SimBackend)
    backend.fail_next = RuntimeError("cuda exploded at 0xdeadbeef")
    error = error_of(httpx.post(f"{srv.v1}/chat/completions", json=CHAT), 500)
    assert error["type"] == "server_error" and "0xdeadbeef" not in error["message"]
    assert httpx.post(f"{srv.v1}/chat/completions", json=CHAT).status_code == 200


def test_unexpected_exception_is_500_without_internals(
    make_server: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server()

    async def broken(*_: object) -> None:
        raise KeyError("internal-secret-path")

    monkeypatch.setattr(srv.arm, "serve", broken)
    response = httpx.post(f"{srv.v1}/chat/completions", json=CHAT)
    error = error_of(response, 500)
    assert error["type"] == "server_error"
    assert "internal-secret-path" not in response.text and "Traceback" not in response.text


def test_loading_model_is_503_until_ready(make_server: Callable[..., LiveServer]) -> None:
    loaded = threading.Event()

    def slow_load() -> SimBackend:
        loaded.wait(10)
        return SimBackend()

    srv = make_server(LocalArm("slow", slow_load), wait_ready=False)
    health = httpx.get(f"{srv.url}/health")
    assert error_of(health, 503)["code"] == "model_loading"
    assert health.headers["retry-after"] == "1"
    busy = error_of(httpx.post(f"{srv.v1}/chat/completions", json=CHAT), 503)
    assert busy["code"] == "model_loading"
    loaded.set()
    wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200)
    assert httpx.post(f"{srv.v1}/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "sim-model", "prompt": "x", "temperature": NaN}',
        b'{"model": "sim-model", "prompt": "x", "repetition_penalty": Infinity}',
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "sim-model", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "sim-model", "prompt": "x", "seed": 99999999999999999999999}',
        b"\xff\xfe not utf-8",
    ],
)
def test_hostile_bodies_are_400_never_500(server: LiveServer, raw: bytes) -> None:
    endpoint = "chat/completions" if b"messages" in raw else "completions"
    response = httpx.post(f"{server.v1}/{endpoint}", content=raw)
    assert error_of(response, 400)["type"] == "invalid_request_error"


def test_clients_may_reuse_a_request_id_concurrently(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(sim_arm(time_scale=1.0))
    body = {**CHAT, "max_tokens": 50, "stream": True}
    headers = {"X-Request-Id": "same"}
    url = f"{srv.v1}/chat/completions"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json=body, headers=headers) as a,
        http.stream("POST", url, json=body, headers=headers) as b,
    ):
        texts = [a.read().decode(), b.read().decode()]
    for text in texts:
        chunks = [json.loads(p) for p in sse_payloads(text)]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["id"] == "chatcmpl-same" for c in chunks)


def test_top_k_minus_one_means_off(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "prompt": "x", "max_tokens": 2, "top_k": -1}
    assert httpx.post(f"{server.v1}/completions", json=body).status_code == 200
