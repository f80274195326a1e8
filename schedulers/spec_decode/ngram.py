"""Prompt-lookup drafts: what followed the longest earlier match of the sequence's suffix.

The rule is vLLM v1's n-gram proposer (vllm/v1/spec_decode/ngram_proposer.py): among the
suffixes of prompt + output whose length n is in [`prompt_lookup_min`, `prompt_lookup_max`],
take the longest that also occurs earlier (an occurrence may overlap the suffix, never be
it), at its earliest occurrence, and propose the up to k tokens that followed it. vLLM finds
it with KMP over the reversed tokens in a numba loop; here numpy finds the earlier positions
of the last token and extends those candidates backwards (`find_draft`).
"""

from __future__ import annotations

import numpy as np

from schedulers.sequence import Sequence
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.history import TokenHistory

#: at most this many earlier occurrences of the last token: extended one by one in Python
_FEW = 8
#: more than total // _DENSE_RATIO occurrences: narrowed over a boolean mask of every position
_DENSE_RATIO = 16


def find_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The up to `k` tokens after the earliest occurrence, before the end, of the longest
    suffix of `tokens` (1-D ints) with length in [`min_n`, `max_n`]; empty when none occurs.

    An occurrence is named by the index of its last token. Every earlier position holding
    the last token starts as a candidate (one vectorised compare); the candidates are then
    extended backwards to the longest match by whichever of three equal strategies is
    cheapest for their number (`_longest_few`, `_longest_sparse`, `_longest_dense`).
    """
    total = tokens.shape[0]
    if k < 1 or total <= min_n:
        return tokens[:0]
    hits = tokens[:-1] == tokens[-1]
    ends = np.flatnonzero(hits)  # ascending
    if not ends.size:
        return tokens[:0]
    if ends.size <= _FEW:
        length, end = _longest_few(tokens, ends, max_n)
    elif ends.size > total // _DENSE_RATIO:
        length, end = _longest_dense(tokens, hits, max_n)
    else:
        length, end = _longest_sparse(tokens, ends, max_n)
    if length < min_n:
        return tokens[:0]
    return tokens[end + 1 : end + 1 + k]


def _longest_few(tokens: np.ndarray, ends: np.ndarray, max_n: int) -> tuple[int, int]:
    """(length, end) of the longest match (capped at `max_n`) among the candidate `ends`,
    the earliest on ties: each candidate's window compared in Python."""
    suffix = tokens[-max_n:].tolist()
    best, best_end = 0, -1
    for end in ends.tolist():
        window = tokens[max(0, end + 1 - max_n) : end + 1].tolist()
        length = _common_tail(window, suffix)
        if length > best:
            best, best_end = length, end
            if best == max_n:
                break
    return best, best_end


def _longest_sparse(tokens: np.ndarray, ends: np.ndarray, max_n: int) -> tuple[int, int]:
    """`_longest_few`'s answer, narrowing the candidate index array one token at a time."""
    total = tokens.shape[0]
    length = 1
    while length < max_n:
        fits = ends  # candidates too close to the start to extend are dropped
        if fits[0] < length:
            fits = fits[np.searchsorted(fits, length) :]
            if not fits.size:
                break
        longer = fits[tokens[fits - length] == tokens[total - 1 - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    return length, int(ends[0])


def _longest_dense(tokens: np.ndarray, hits: np.ndarray, max_n: int) -> tuple[int, int]:
    """`_longest_few`'s answer from the mask `hits` of candidate ends (many of them): one
    shifted compare of the whole sequence per token of match, no index arrays."""
    total = tokens.shape[0]
    length = 1
    while length < min(max_n, total - 1):
        longer = hits.copy()
        longer[:length] = False
        longer[length:] &= tokens[: total - 1 - length] == tokens[total - 1 - length]
        if not longer.any():
            break
        hits, length = longer, length + 1
    return length, int(hits.argmax())


def _common_tail(a: list[int], b: list[int]) -> int:
    """How many trailing items `a` and `b` share."""
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n


class NgramProposer:
    """Proposes each sequence's drafts from its own prompt and output (`find_draft`).

    Keeps every sequence's tokens in numpy (`TokenHistory`), so a step copies only the
    tokens sampled since the last one; `release` a sequence when it finishes.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._history = TokenHistory()

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `seq`'s last token (empty: no match, or k < 1)."""
        if k < 1:
            return []
        draft = find_draft(self._history.tokens(seq), k, self.min_n, self.max_n)
        return draft.tolist()  # type: ignore[no-any-return]

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's tokens."""
        self._history.release(seq_id)
