"""POST /v1/completions: the four prompt forms, echo, logprobs, streaming, refusals."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import SIM_MODEL, LiveServer, sse_payloads


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_text_completion_body_has_openai_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(model=SIM_MODEL, prompt="Once upon", max_tokens=5)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    [choice] = response.choices
    assert len(choice.text) == 5 and choice.finish_reason == "length"
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9, 5)


def test_default_max_tokens_is_16_as_in_openai(client: openai.OpenAI) -> None:
    response = client.completions.create(model=SIM_MODEL, prompt="x")
    assert response.usage is not None and response.usage.completion_tokens == 16


@pytest.mark.parametrize(
    ("prompt", "num_prompts", "prompt_tokens"),
    [
        ("abc", 1, 3),
        (["abc", "de"], 2, 5),
        ([97, 98, 99], 1, 3),
        ([[97, 98, 99], [100]], 2, 4),
    ],
)
def test_every_prompt_form_is_served(
    client: openai.OpenAI, prompt: object, num_prompts: int, prompt_tokens: int
) -> None:
    response = client.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=3, n=2)
    assert [c.index for c in response.choices] == list(range(2 * num_prompts))
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 2 * num_prompts * 3


def test_token_id_prompt_matches_its_text(client: openai.OpenAI) -> None:
    by_text = client.completions.create(model=SIM_MODEL, prompt="abc", max_tokens=6, temperature=0)
    by_ids = client.completions.create(
        model=SIM_MODEL, prompt=[97, 98, 99], max_tokens=6, temperature=0
    )
    assert by_text.choices[0].text == by_ids.choices[0].text


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=SIM_MODEL, prompt="Say:", max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=SIM_MODEL, prompt="Say:", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Say:" + plain.choices[0].text


def test_completion_logprobs_have_the_legacy_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=4, logprobs=3)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 4
    assert logprobs.top_logprobs is not None
    assert all(isinstance(t, dict) and 1 <= len(t) <= 3 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, 1, 2, 3]


def test_streamed_completion_equals_the_whole_one(server: LiveServer) -> None:
    body = {"model": SIM_MODEL, "prompt": "abc", "max_tokens": 7, "temperature": 0}
    whole = httpx.post(f"{server.v1}/completions", json=body).json()
    streamed = httpx.post(f"{server.v1}/completions", json={**body, "stream": True})
    chunks = [json.loads(p) for p in sse_payloads(streamed.text)]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_usage_chunk_for_completions(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=SIM_MODEL,
            prompt=["a", "b"],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    finished = sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_streamed_logprobs_offsets_continue_across_chunks(client: openai.OpenAI) -> None:
    chunks = client.completions.create(
        model=SIM_MODEL, prompt="x", max_tokens=5, logprobs=1, stream=True
    )
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []
    ]
    assert offsets == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "tail"}, "suffix"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 999999]}, "prompt"),
        ({"prompt": ["ok", ""]}, "prompt[1]"),
        ({"logprobs": 6}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"n": 129}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_values_are_400_naming_the_param(
    server: LiveServer, extra: dict[str, object], param: str
) -> None:
    body = {"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    response = httpx.post(f"{server.v1}/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_logit_bias_reaches_the_sampler(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=SIM_MODEL, prompt="hi", max_tokens=3, logit_bias={"65": 100}
    )
    assert response.choices[0].text == "AAA"  # the simulator obeys a +100 bias
