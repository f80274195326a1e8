"""Engine logprobs (`TokenLogprob`) in the two OpenAI shapes: chat's and legacy completions'.

Token strings are each token id decoded alone (`tokenizer.decode([id])`), which reads as
text, unlike `convert_ids_to_tokens`' byte-level BPE symbols.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gateway.api.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from schedulers.sequence import TokenLogprob as EngineLogprob

TokenText = Callable[[int], str]


def _finite(logprob: float) -> float:
    """JSON has no -inf: clamp impossible tokens to the most negative float32-ish value."""
    return logprob if math.isfinite(logprob) else -9999.0


def _top(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(
    logprobs: Sequence[EngineLogprob], token_text: TokenText, num_top: int
) -> ChatLogprobs:
    """`choices[].logprobs` of a chat completion (or the part of it in one chunk)."""
    content = []
    for entry in logprobs:
        top = [_top(token_text, t, lp) for t, lp in entry.top[:num_top]]
        base = _top(token_text, entry.token_id, entry.logprob)
        content.append(TokenLogprob(**base.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    logprobs: Sequence[EngineLogprob],
    token_text: TokenText,
    num_top: int,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """`choices[].logprobs` of a text completion; offsets start at `text_offset`."""
    out = CompletionLogprobs()
    offset = text_offset
    for entry in logprobs:
        text = token_text(entry.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(entry.logprob))
        out.top_logprobs.append({token_text(t): _finite(lp) for t, lp in entry.top[:num_top]})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def text_length(logprobs: CompletionLogprobs) -> int:
    """Where the next chunk's offsets continue."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
