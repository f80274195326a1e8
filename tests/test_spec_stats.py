"""Speculative decoding's counters count drafts, draft tokens and accepted tokens as vLLM."""

from __future__ import annotations

import pytest

from schedulers.spec_decode.stats import SpecDecodingStats


def test_counters_add_up_per_draft_and_per_position() -> None:
    stats = SpecDecodingStats(num_speculative_tokens=3)
    assert stats.mean_acceptance_length is None
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (0, 0)):  # the last proposed nothing
        stats.observe(drafted, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_impossible_counts_are_refused() -> None:
    stats = SpecDecodingStats(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="3 accepted of 2 drafts"):
        stats.observe(2, 3)
    with pytest.raises(ValueError, match="at most 2"):
        stats.observe(4, 1)
