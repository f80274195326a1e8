"""Incremental detokenization with stop strings: never broken UTF-8, never a leaked stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# NOTE: decoding starts a few prompt tokens back so the first output token's leading space
# (SentencePiece / byte-level BPE) comes out as it would in a full decode.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


def fast_decode(tokenizer: Any) -> Decode:
    """`tokenizer.decode` itself, or straight through its Rust `tokenizers` backend where that
    is the same text: an HF fast tokenizer whose decode nobody overrides and which cleans up
    no spaces afterwards. (HF's Python layers around that call cost more than the decode: two
    calls per token per sequence, on the event loop.)
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and isinstance(backend, Tokenizer)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: str(tokenizer.decode(ids, skip_special_tokens=skip))


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, a few tokens at a time.

    `add_tokens` decodes only the tail window (prefix / read offsets, as in vLLM) and holds
    back text that ends in an incomplete UTF-8 character. Stop strings are searched in the
    text not yet released; on a match the text is cut before the stop string and `stopped`
    is set. `take` releases new text, holding back any tail that could still grow into a
    stop string until the sequence is final.

    NOTE: only the unreleased text is kept and searched. No stop string can begin in text
    already released: `take` holds back every tail that is the start of one. It runs on the
    event loop once per token per sequence, so the path without stop strings does no search.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = fast_decode(tokenizer)
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        #: decoded text not yet released by `take` (already cut at a stop string)
        self._pending = ""
        self.stopped = False

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append sampled tokens; extends the pending text and checks stop strings."""
        if self.stopped:
            return
        self._ids.extend(token_ids)
        delta = self._decode_delta(final=False)
        if delta:
            self._append(delta)

    def finish(self) -> None:
        """Release text held back for an incomplete character (the sequence has ended)."""
        if not self.stopped:
            delta = self._decode_delta(final=True)
            if delta:
                self._append(delta)

    def take(self, final: bool = False) -> str:
        """New text since the last call; with `final`, everything left."""
        text = self._pending
        if final or self.stopped or not self._stop:
            self._pending = ""
            return text
        end = self._safe_end(text)
        self._pending = text[end:]
        return text[:end]

    def _decode_delta(self, final: bool) -> str:
        ids, decode, skip = self._ids, self._decode_ids, self._skip_special
        prefix = decode(ids[self._prefix_offset : self._read_offset], skip)
        full = decode(ids[self._prefix_offset :], skip)
        if len(full) <= len(prefix) or (not final and full.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> None:
        if not self._stop:
            self._pending += delta
            return
        # NOTE: a stop string that completes now ends in `delta`, so it starts no earlier
        search_from = max(0, len(self._pending) - self._longest_stop + 1)
        text = self._pending = self._pending + delta
        hits = [i for s in self._stop if (i := text.find(s, search_from)) >= 0]
        if hits:
            self._pending = text[: min(hits)]
            self.stopped = True

    def _safe_end(self, text: str) -> int:
        """End of the text that cannot be the start of a stop string."""
        for k in range(min(len(text), self._longest_stop), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return len(text) - k
        return len(text)
