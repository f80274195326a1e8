"""Property tests for several stop strings at once (tests/test_detokenizer.py covers one).

Tokens arrive one per engine iteration, so generation must stop at the first token after
which any stop string appears, and the text is cut at the earliest stop string seen then.
A small alphabet makes stop strings overlap, nest and share prefixes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.byte_tokenizer import ByteTokenizer
from gateway.api.protocol import MAX_STOP_SEQUENCES
from schedulers.detokenizer import IncrementalDetokenizer

ALPHABET = "ab é€\n"
TEXT = st.text(alphabet=ALPHABET, min_size=0, max_size=40)
STOP = st.text(alphabet=ALPHABET, min_size=1, max_size=6)


def expected_output(text: str, stops: list[str]) -> str:
    """The text a client must see: cut where the first stop string completes."""
    for end in range(1, len(text) + 1):
        hits = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if hits:
            return text[: min(hits)]
    return text


def stream_tokens(text: str, stops: list[str]) -> tuple[list[str], bool]:
    """Feed `text`'s tokens one at a time; the released deltas and whether it stopped."""
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [65], stops)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add_tokens([token])
        deltas.append(detok.take())
        if detok.stopped:
            return deltas, True
    detok.finish()
    deltas.append(detok.take(final=True))
    return deltas, False


@settings(max_examples=300, deadline=None)
@given(
    text=TEXT,
    stops=st.lists(STOP, min_size=1, max_size=MAX_STOP_SEQUENCES),
    picks=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 5)), max_size=2),
)
def test_several_stop_strings_cut_at_the_first_completed_one(
    text: str, stops: list[str], picks: list[tuple[int, int]]
) -> None:
    stops = stops + [text[i : i + n] for i, n in picks if text[i : i + n]]  # some surely hit
    stops = stops[:MAX_STOP_SEQUENCES]
    deltas, stopped = stream_tokens(text, stops)
    joined = "".join(deltas)
    assert joined == expected_output(text, stops)
    assert stopped == (joined != text or any(s in text for s in stops))
    assert not any(s in joined for s in stops)
    assert all("\ufffd" not in d for d in deltas)


def held_back(text: str, stop: str) -> int:
    """Characters at the end of `text` that could still grow into `stop`."""
    return next(
        (m for m in range(min(len(text), len(stop)), 0, -1) if stop.startswith(text[-m:])), 0
    )


ASCII = st.text(alphabet="ab \n", min_size=0, max_size=40)


@settings(max_examples=100, deadline=None)
@given(text=ASCII, stop=st.text(alphabet="ab \n", min_size=200, max_size=256))
def test_a_long_stop_string_holds_back_only_what_could_still_match(text: str, stop: str) -> None:
    """One character per token: after each, exactly the text that cannot start `stop` is out."""
    deltas, stopped = stream_tokens(text, [stop])
    assert "".join(deltas) == text and not stopped
    for k in range(1, len(text) + 1):
        released = "".join(deltas[:k])
        assert released == text[: k - held_back(text[:k], stop)]
