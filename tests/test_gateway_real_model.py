"""The real default model (SmolLM2-135M-Instruct, torch backend) end to end through HTTP."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.real_model

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


@pytest.fixture(scope="module")
def real_client(default_model_url: str) -> openai.OpenAI:
    """A client of the session's default-model server (tests/conftest.py)."""
    return openai.OpenAI(base_url=f"{default_model_url}/v1", api_key="unused", max_retries=0)


def test_default_model_answers_the_capital_of_france(real_client: openai.OpenAI) -> None:
    [model] = real_client.models.list().data
    assert model.id == "smollm2-135m-instruct"
    reply = real_client.chat.completions.create(
        model=model.id,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"


def test_default_model_streams_the_same_answer(real_client: openai.OpenAI) -> None:
    stream = real_client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        logprobs=True,
        top_logprobs=2,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "The capital of France is Paris."
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries[0].token == "The" and len(entries[0].top_logprobs) == 2
    assert entries[0].top_logprobs[0].token == "The"  # greedy: the top token is the one taken
