"""Incremental detokenization: never broken UTF-8, stop strings never leak."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from backends.byte_tokenizer import ByteTokenizer
from backends.torch.loader import resolve_model
from backends.torch.testing.tiny_models import tiny_tokenizer
from schedulers.detokenizer import IncrementalDetokenizer, fast_decode

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


@functools.cache
def default_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("default"))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_fast_decode_is_the_tokenizers_own_decode(data: st.DataObject, skip: bool) -> None:
    """Ids of any kind (special tokens, bytes cut mid-character) decode to the same text."""
    for tokenizer in (default_tokenizer(), HF_BYTES):
        ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=12))
        specials = data.draw(st.lists(st.sampled_from(tokenizer.all_special_ids), max_size=2))
        ids = ids[:3] + specials + ids[3:]
        assert fast_decode(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_fast_decode_goes_through_hf_where_the_text_could_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = default_tokenizer()
    calls: list[list[int]] = []
    hf_decode = tokenizer.decode

    def spy(ids: list[int], **kwargs: bool) -> str:
        calls.append(ids)
        return str(hf_decode(ids, **kwargs))

    monkeypatch.setattr(tokenizer, "decode", spy)
    assert fast_decode(tokenizer)([5, 6], False) == hf_decode([5, 6])
    assert calls == []  # straight through the Rust backend
    with monkeypatch.context() as patch:  # spaces cleaned up afterwards: HF's decode
        patch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
        fast_decode(tokenizer)([7], False)
    with monkeypatch.context() as patch:  # a tokenizer class of its own decoding
        own = type("Own", (type(tokenizer),), {"_decode": lambda self, token_ids, **kwargs: "x"})
        patch.setattr(tokenizer, "__class__", own)
        fast_decode(tokenizer)([8], False)
    assert calls == [[7], [8]]
    assert fast_decode(ByteTokenizer())([104, 105], True) == "hi"
