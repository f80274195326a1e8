"""POST /v1/chat/completions through the real OpenAI SDK and raw SSE, on the simulator."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from tests.conftest import SIM_MODEL, LiveServer, sse_payloads

HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_chat_completion_body_has_openai_shape(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=SIM_MODEL, messages=HELLO, max_tokens=8)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == SIM_MODEL
    [choice] = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert len(choice.message.content or "") == 8  # byte tokens, no EOS in the simulator
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    usage = response.usage
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 8


def test_n2_returns_two_choices_and_counts_all_their_tokens(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=5, n=2, temperature=1.0, seed=7
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content != response.choices[1].message.content
    assert response.usage is not None
    assert response.usage.completion_tokens == 10
    single = client.chat.completions.create(model=SIM_MODEL, messages=HELLO, max_tokens=5)
    assert single.usage is not None
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # counted once


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=9, max_completion_tokens=3
    )
    assert response.usage is not None and response.usage.completion_tokens == 3


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=SIM_MODEL, messages=HELLO)
    assert response.usage is not None
    assert response.usage.total_tokens == 1024  # the test arm's context window
    assert response.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text_and_finishes_with_stop(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=40, temperature=0
    )
    text = full.choices[0].message.content or ""
    stop = text[10:12]
    cut = text[: text.index(stop)]
    stopped = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=40, temperature=0, stop=[stop, "@@@"]
    )
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=SIM_MODEL, messages=HELLO, max_tokens=24, temperature=1.0, seed=seed
        )
        return response.choices[0].message.content or ""

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_chat_logprobs_have_openai_shape(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 4
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)


def test_stream_sends_role_first_then_deltas_then_finish(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=SIM_MODEL, messages=HELLO, max_tokens=6, temperature=0, stream=True
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first, last = chunks[0].choices[0], chunks[-1].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert last.finish_reason == "length"
    assert last.delta.content is None and last.delta.role is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].message.content


def test_stream_with_n2_interleaves_choices_each_finished(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=SIM_MODEL, messages=HELLO, max_tokens=3, n=2, stream=True
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    assert roles == [0, 1]


def test_usage_chunk_comes_last_and_every_other_chunk_has_null_usage(server: LiveServer) -> None:
    body = {
        "model": SIM_MODEL,
        "messages": HELLO,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{server.v1}/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(p) for p in sse_payloads(response.text)]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 4


def test_stream_without_usage_option_has_no_usage_key(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "messages": HELLO, "max_tokens": 2, "stream": True}
    response = httpx.post(f"{server.v1}/chat/completions", json=body)
    chunks = [json.loads(p) for p in sse_payloads(response.text)]
    assert chunks and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_stream_logprobs_arrive_with_their_deltas(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model=SIM_MODEL, messages=HELLO, max_tokens=3, stream=True, logprobs=True, top_logprobs=1
    )
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 1 for e in entries)


def test_content_parts_and_developer_role_are_accepted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SIM_MODEL,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        max_tokens=2,
    )
    # the simulator's byte-level template, with developer read as system and parts joined
    prompt = "<system>Be brief.\n<user>a\nb\n<assistant>ok\n<user>again\n<assistant>"
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt)


def test_unknown_fields_are_ignored_and_logged(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "messages": HELLO, "max_tokens": 2, "store": True, "zz_x": 1}
    with capture_logs() as logs:
        response = httpx.post(f"{server.v1}/chat/completions", json=body)
    assert response.status_code == 200
    [line] = [e for e in logs if e["event"] == "ignored_unknown_fields"]
    assert line["fields"] == ["store", "zz_x"]


def test_one_access_log_line_per_request_without_prompt_text(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "secret words"}]}
    with capture_logs() as logs:
        httpx.post(
            f"{server.v1}/chat/completions",
            json={**body, "max_tokens": 3},
            headers={"X-Request-Id": "abc-123"},
        )
    [line] = [e for e in logs if e["event"] == "request"]
    assert line["request_id"] == "abc-123"
    assert line["status"] == 200 and line["completion_tokens"] == 3
    assert line["model"] == SIM_MODEL and line["arm"] == "orca" and line["scheduler"] == "orca"
    assert line["finish_reason"] == "length" and line["ttft_s"] is not None
    assert "secret" not in json.dumps(logs)


def test_request_id_header_is_used_and_echoed(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "messages": HELLO, "max_tokens": 1}
    response = httpx.post(
        f"{server.v1}/chat/completions", json=body, headers={"X-Request-Id": "my-req-1"}
    )
    assert response.headers["x-request-id"] == "my-req-1"
    assert response.json()["id"] == "chatcmpl-my-req-1"
    generated = httpx.post(f"{server.v1}/chat/completions", json=body)
    assert generated.json()["id"] == "chatcmpl-" + generated.headers["x-request-id"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=SIM_MODEL, messages=HELLO, max_tokens=1, extra_body=extra
        )
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.code == "unsupported_parameter"


def test_harmless_forms_of_unimplemented_fields_are_accepted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SIM_MODEL,
        messages=HELLO,
        max_tokens=1,
        response_format={"type": "text"},
        parallel_tool_calls=True,
        tool_choice="none",
        user="u-1",
    )
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        (
            [{"role": "system", "content": "s"}, {"role": "tool", "content": "r"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "s"},
                {"role": "tool", "content": "r", "tool_call_id": "x"},
            ],
            "messages[1].tool_call_id",
        ),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([], "messages"),
    ],
)
def test_bad_messages_name_the_param(
    client: openai.OpenAI, messages: list[dict[str, object]], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SIM_MODEL, messages=messages, max_tokens=1)
    assert info.value.param == param
