"""Prompts of an exact token count, for replaying traces that give lengths instead of text.

A remote server's tokenizer is unknown to the bench, but its `usage.prompt_tokens` is not:
the probe (bench/probe.py) sends two prompts of `PROBE_WORDS` that differ only in how many
words they hold and fits `tokens = fixed + per_word * words` (a BPE vocabulary gives one token
per word, a byte-level one four: each word is a space and three letters). A prompt of N tokens
is then (N - fixed) // per_word words and, for the remainder, as many single letters (one token
each under a byte-level tokenizer). When the server reports no usage the cost is taken as one
token per word and nothing around it, and the lengths are approximate (the report says so).

Mooncake's traces name each 512-token block of a prompt by a hash id, shared ids meaning a
shared prefix: block `h` is always the same text (drawn with the seed and `h`), so requests that
share ids share their prompt's prefix and a prefix cache sees them as the original system did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: three-letter words: one token each with its leading space in common BPE vocabularies, four
#: bytes under a byte-level tokenizer, so every word costs the same
_WORD_TEXT = (
    "the and you for are was his one had but not all can her out use two how its who did "
    "get may day now way new any see man old boy too end why ask men off put set big air say "
    "own try war far run sun car red top box dog cat sea"
)
PROBE_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
MOONCAKE_BLOCK_TOKENS = 512
FILLER = "x"


@dataclass(frozen=True)
class PromptCost:
    """How a server counts a prompt of `PROBE_WORDS`: `fixed + per_word * words` tokens."""

    per_word: int
    fixed: int
    measured: bool = True


UNMEASURED = PromptCost(1, 0, measured=False)


def probe_prompt(num_words: int) -> str:
    """The calibration prompt: `num_words` words, each with its leading space."""
    return "".join(f" {PROBE_WORDS[i % len(PROBE_WORDS)]}" for i in range(num_words))


def _words(rng: np.random.Generator, num_tokens: int, cost: PromptCost) -> str:
    """Text of exactly `num_tokens` content tokens under `cost` (at least one character)."""
    count, rest = divmod(max(num_tokens, 1), cost.per_word)
    picks = rng.integers(0, len(PROBE_WORDS), size=count)
    return "".join(f" {PROBE_WORDS[i]}" for i in picks) + FILLER * rest


def exact_prompt(rng: np.random.Generator, num_tokens: int, cost: PromptCost) -> str:
    """A prompt the server counts as `num_tokens` tokens (template included)."""
    return _words(rng, num_tokens - cost.fixed, cost)


def block_prompt(hash_ids: Sequence[int], num_tokens: int, cost: PromptCost, seed: int) -> str:
    """A prompt of `num_tokens` tokens made of Mooncake's blocks: block `h` is the same
    `MOONCAKE_BLOCK_TOKENS` tokens of text wherever it appears; the last block is cut to fit,
    and the prompt grows past its blocks when the count asks for more."""
    left = max(num_tokens - cost.fixed, 1)
    parts = []
    for i, h in enumerate(hash_ids):
        if left <= 0:
            break
        take = min(left, MOONCAKE_BLOCK_TOKENS) if i < len(hash_ids) - 1 else left
        parts.append(_block(h, take, cost, seed))
        left -= take
    if left > 0:
        parts.append(_words(np.random.default_rng([seed, 7]), left, cost))
    return "".join(parts)


def _block(hash_id: int, num_tokens: int, cost: PromptCost, seed: int) -> str:
    """The first `num_tokens` tokens of block `hash_id` (beyond a block: more of its words)."""
    rng = np.random.default_rng([seed, 6, hash_id])
    count, rest = divmod(num_tokens, cost.per_word)
    picks = rng.integers(0, len(PROBE_WORDS), size=count)
    return "".join(f" {PROBE_WORDS[i]}" for i in picks) + FILLER * rest
