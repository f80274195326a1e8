"""Stream chunks filled in from a template are the bytes pydantic would have written."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.chunk_template import TextChunks
from gateway.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)

# NOTE: every code point but lone surrogates (no UTF-8 text holds one), control characters,
# quotes and backslashes included
TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24)


def completion(model: str) -> TextChunks:
    return TextChunks(
        lambda index, text: CompletionResponse(
            id="cmpl-x", created=7, model=model, choices=[CompletionChoice(index=index, text=text)]
        ).model_dump_json(exclude={"usage"})
    )


def chat(index: int, text: str, model: str = "m") -> str:
    choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text))
    chunk = ChatCompletionChunk(id="chatcmpl-x", created=7, model=model, choices=[choice])
    return chunk.model_dump_json()


@settings(max_examples=300, deadline=None)
@given(text=TEXT, index=st.integers(0, 3), model=st.sampled_from(["m", 'q"\\/é']))
def test_a_filled_template_is_the_models_own_json(text: str, index: int, model: str) -> None:
    chunks = completion(model)
    render = completion(model)._render
    assert chunks(index, "warm") == render(index, "warm")  # the template, made
    assert chunks(index, text) == render(index, text)
    chats = TextChunks(lambda i, t: chat(i, t, model))
    assert chats(index, text) == chat(index, text, model)


def test_a_render_with_the_marker_twice_is_rendered_every_time() -> None:
    calls: list[str] = []

    def render(index: int, text: str) -> str:
        calls.append(text)
        return chat(index, text, model=text)  # the model is named like the text, marker too

    chunks = TextChunks(render)
    assert chunks(0, "a") == chat(0, "a", model="a")
    assert chunks(0, "b") == chat(0, "b", model="b")
    assert calls[1:] == ["a", "b"]  # no template: each chunk went through the model
