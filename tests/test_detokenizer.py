"""Incremental detokenization: never broken UTF-8, stop strings never leak."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.byte_tokenizer import ByteTokenizer
from schedulers.detokenizer import IncrementalDetokenizer
from tests.tiny_models import tiny_tokenizer

HF_BYTES = tiny_tokenizer()
TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=40
)


def stream(tokenizer: object, text: str, stop: tuple[str, ...] = (), chunk: int = 1) -> list[str]:
    """Feed `text`'s tokens `chunk` at a time; return every released delta (last is final)."""
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tokenizer, [65, 66], stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.add_tokens(ids[i : i + chunk])
        deltas.append(detok.take())
        if detok.stopped:
            return deltas
    detok.finish()
    deltas.append(detok.take(final=True))
    return deltas


@settings(max_examples=150, deadline=None)
@given(text=TEXT, chunk=st.integers(1, 4))
def test_streamed_text_is_the_text_and_never_has_a_broken_character(text: str, chunk: int) -> None:
    for tokenizer in (HF_BYTES, ByteTokenizer()):
        deltas = stream(tokenizer, text, chunk=chunk)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, data=st.data())
def test_stop_string_cuts_the_text_and_never_leaks(text: str, data: st.DataObject) -> None:
    if not text:
        return
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    deltas = stream(ByteTokenizer(), text, stop=(stop,))
    joined = "".join(deltas)
    assert joined == text[: text.find(stop)]
    assert stop not in joined


def test_text_that_only_might_become_a_stop_string_is_released_at_the_end() -> None:
    deltas = stream(ByteTokenizer(), "ab END", stop=("ENDING",))
    assert "".join(deltas) == "ab END"
    assert deltas[-1].endswith("END")  # held back until it could no longer match


def test_first_token_keeps_its_leading_space() -> None:
    detok = IncrementalDetokenizer(HF_BYTES, HF_BYTES.encode("Hello"))
    detok.add_tokens(HF_BYTES.encode(" world"))
    assert detok.take() == " world"
