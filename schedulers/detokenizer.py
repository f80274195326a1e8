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
    accumulated text; on a match the text is cut before the stop string and `stopped` is set.
    `take` releases new text, holding back any tail that could still grow into a stop string
    until the sequence is final.
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
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self.stopped = False
        self._emitted = 0

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append sampled tokens; extends `output_text` and checks stop strings."""
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
        end = len(self.output_text) if final or self.stopped else self._safe_end()
        text = self.output_text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip_special)

    def _decode_delta(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> None:
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, len(self.output_text) - longest + 1)
        self.output_text += delta
        if not self._stop:
            return
        hits = [i for s in self._stop if (i := self.output_text.find(s, search_from)) >= 0]
        if hits:
            self.output_text = self.output_text[: min(hits)]
            self.stopped = True

    def _safe_end(self) -> int:
        """End of the text that cannot be the start of a stop string."""
        text = self.output_text
        for k in range(min(len(text), max((len(s) for s in self._stop), default=0)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return len(text) - k
        return len(text)
