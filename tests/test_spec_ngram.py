"""Prompt-lookup drafts are vLLM's: the longest suffix n-gram seen before, at its earliest
occurrence, and up to k tokens after it (checked against a brute-force reading of the rule)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.history import TokenHistory
from schedulers.spec_decode.ngram import (
    NgramProposer,
    _longest_dense,
    _longest_few,
    _longest_sparse,
    find_draft,
)


def longest_match(tokens: list[int], max_n: int) -> tuple[int, int]:
    """(n, end): the longest n <= max_n whose suffix occurs ending at an earlier index `end`
    (the smallest such end); (0, -1) when the last token never occurred before."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), 0, -1):
        for end in range(n - 1, total - 1):
            if tokens[end + 1 - n : end + 1] == tokens[total - n :]:
                return n, end
    return 0, -1


def reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n, end = longest_match(tokens, max_n)
    if k < 1 or n < min_n:
        return []
    return tokens[end + 1 : end + 1 + k]


def as_array(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


small_vocab_tokens = st.lists(st.integers(0, 3), max_size=60)


@settings(max_examples=400, deadline=None)
@given(
    small_vocab_tokens,
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(0, 4),
)
def test_find_draft_equals_the_brute_force_rule(
    tokens: list[int], k: int, min_n: int, extra: int
) -> None:
    max_n = min_n + extra
    got = find_draft(as_array(tokens), k, min_n, max_n).tolist()
    assert got == reference_draft(tokens, k, min_n, max_n)


Strategy = Callable[[np.ndarray, np.ndarray, int], tuple[int, int]]


@pytest.mark.parametrize(
    "strategy",
    [
        _longest_few,
        _longest_sparse,
        lambda tokens, ends, max_n: _longest_dense(tokens, tokens[:-1] == tokens[-1], max_n),
    ],
    ids=["few", "sparse", "dense"],
)
@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=80), max_n=st.integers(1, 7))
def test_every_match_strategy_finds_the_longest_earliest_match(
    strategy: Strategy, tokens: list[int], max_n: int
) -> None:
    array = as_array(tokens)
    ends = np.flatnonzero(array[:-1] == array[-1])
    if not ends.size:
        return  # find_draft never asks a strategy then
    assert strategy(array, ends, max_n) == longest_match(tokens, max_n)


def test_vllms_docstring_example() -> None:
    # [4, 2, 3] (max_n) never occurred; [2, 3] did, followed by [4, 2, 3]
    assert find_draft(as_array([1, 2, 3, 4, 2, 3]), 4, 2, 3).tolist() == [4, 2, 3]


def test_the_earliest_occurrence_of_the_longest_match_wins() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 9, 7, 8]
    assert find_draft(as_array(tokens), 1, 2, 2).tolist() == [1]  # not [2], the later one
    longer = [5, 7, 8, 3, 6, 7, 8, 4, 5, 7, 8]  # [5, 7, 8] beats the later [7, 8]
    assert find_draft(as_array(longer), 2, 2, 3).tolist() == [3, 6]


def test_an_occurrence_may_overlap_the_suffix() -> None:
    assert find_draft(as_array([5, 5, 5, 5]), 3, 1, 3).tolist() == [5]


def test_no_draft_without_a_long_enough_earlier_match() -> None:
    assert find_draft(as_array([1, 2, 3, 4]), 3, 1, 3).size == 0  # 4 never seen before
    assert find_draft(as_array([1, 2, 9, 2]), 3, 2, 3).size == 0  # only [2] repeats
    assert find_draft(as_array([1, 1]), 3, 2, 2).size == 0  # shorter than min_n + 1
    assert find_draft(as_array([1, 1, 1]), 0, 1, 2).size == 0  # k = 0


def test_the_dense_path_handles_a_run_of_one_token() -> None:
    run = as_array([3] * 4096)
    assert find_draft(run, 4, 2, 5).tolist() == [3, 3, 3, 3]


def sequence(prompt: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, "r", prompt, SamplingParams(max_tokens=64))


def test_the_proposer_follows_the_sequence_as_it_grows() -> None:
    proposer = NgramProposer.from_config(
        SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=3)
    )
    seq = sequence([10, 11, 12, 13, 14, 10, 11])
    assert proposer.propose(seq, 3) == [12, 13, 14]
    seq.output_token_ids += [12, 13]
    assert proposer.propose(seq, 3) == [14, 10, 11]
    assert proposer.propose(seq, 0) == []
    proposer.release(seq.seq_id)
    assert proposer.propose(seq, 2) == [14, 10]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=20),
    st.lists(st.lists(st.integers(0, 5), max_size=400), max_size=8),
)
def test_the_history_equals_the_sequence_after_any_growth(
    prompt: list[int], steps: list[list[int]]
) -> None:
    history = TokenHistory()
    seq = sequence(prompt)
    for new in steps:
        seq.output_token_ids += new
        assert history.tokens(seq).tolist() == seq.all_token_ids()


def test_invalid_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
