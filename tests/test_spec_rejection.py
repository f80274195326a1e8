"""The rejection sampler keeps greedy output exact and sampled output distributed as the
target's, whatever the drafts (chi-square tests on a known five-token vocabulary, seeded)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch.sample import rejection
from backends.torch.sample.rejection import rejection_sample
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from schedulers.spec_decode.ngram import NgramProposer

stats = pytest.importorskip("scipy.stats")

#: the target's distributions at three consecutive positions of a five-token vocabulary
P0 = [0.05, 0.15, 0.30, 0.20, 0.30]
P1 = [0.40, 0.10, 0.05, 0.25, 0.20]
P2 = [0.10, 0.30, 0.20, 0.20, 0.20]
NUM_SAMPLES = 20_000


def greedy_rows(drafts: list[list[int]], argmax: list[list[int]]) -> list[list[int]]:
    return rejection_sample(
        drafts, [True] * len(drafts), target_argmax=torch.tensor(sum(argmax, []))
    )


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    assert greedy_rows([[5, 6, 7]], [[5, 6, 9, 3]]) == [[5, 6, 9]]  # mismatch at position 2
    assert greedy_rows([[5, 6, 7]], [[5, 6, 7, 3]]) == [[5, 6, 7, 3]]  # all taken + bonus
    assert greedy_rows([[5, 6, 7]], [[4, 6, 7, 3]]) == [[4]]  # first rejected
    assert greedy_rows([[]], [[8]]) == [[8]]  # no draft: a plain decode


def toy_model(context: list[int]) -> int:
    """A deterministic next token over 6 ids: repetitive enough for lookup drafts to hit."""
    return (context[-1] * 3 + (context[-2] if len(context) > 1 else 0) + len(context) // 7) % 6


def greedy_decode(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(toy_model(tokens))
    return tokens[len(prompt) :]


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    k=st.integers(1, 6),
    noise=st.lists(st.integers(0, 5), max_size=40),
    num_tokens=st.integers(1, 40),
)
def test_speculative_greedy_decoding_is_token_for_token_plain_greedy(
    prompt: list[int], k: int, noise: list[int], num_tokens: int
) -> None:
    """A verify loop (drafts from prompt lookup, some corrupted by `noise`) emits exactly
    what decoding one token per step emits, and at least one token per verified step."""
    proposer = NgramProposer(1, 3)
    seq = Sequence(0, "r", list(prompt), SamplingParams(max_tokens=num_tokens, temperature=0))
    noise_left = list(noise)
    while seq.num_output_tokens < num_tokens:
        drafts = proposer.propose(seq, k)
        if drafts and noise_left:  # corrupt one draft: the next two noise values say how
            where, value = noise_left.pop(), noise_left.pop() if noise_left else 0
            drafts[where % len(drafts)] = value
        context = seq.all_token_ids()
        argmax = [toy_model(context + drafts[:j]) for j in range(len(drafts) + 1)]
        (emitted,) = greedy_rows([drafts], [argmax])
        assert 1 <= len(emitted) <= len(drafts) + 1
        seq.output_token_ids += emitted[: num_tokens - seq.num_output_tokens]
    assert seq.output_token_ids == greedy_decode(prompt, num_tokens)


def sample_rows(
    positions: list[list[float]], drafts: list[int], num_rows: int, seed: int = 0
) -> list[list[int]]:
    """`num_rows` sampled rows, each verifying `drafts` against the target `positions`."""
    assert len(positions) == len(drafts) + 1
    probs = torch.tensor(positions, dtype=torch.float32).repeat(num_rows, 1)  # (R * (k+1), V)
    generator = torch.Generator().manual_seed(seed)
    return rejection_sample(
        [drafts] * num_rows,
        [False] * num_rows,
        target_probs=probs,
        generators=[generator] * num_rows,
    )


def chi_square_p(tokens: list[int], expected: list[float]) -> float:
    """The chi-square p-value of `tokens` against the distribution `expected` (zero-mass
    tokens left out: they must not occur at all)."""
    counts = Counter(tokens)
    support = [t for t, p in enumerate(expected) if p > 0]
    assert all(expected[t] > 0 for t in counts), "a zero-probability token was emitted"
    observed = np.array([counts[t] for t in support], dtype=float)
    mass = np.array([expected[t] for t in support])
    return float(stats.chisquare(observed, mass / mass.sum() * observed.sum()).pvalue)


@pytest.mark.parametrize("draft", [2, 0, 4], ids=["likely", "unlikely", "tied-top"])
def test_the_first_emitted_token_has_the_targets_distribution(draft: int) -> None:
    rows = sample_rows([P0, P1], [draft], NUM_SAMPLES)
    assert chi_square_p([row[0] for row in rows], P0) > 0.001


def test_a_zero_probability_draft_is_never_accepted() -> None:
    p0 = [0.25, 0.25, 0.0, 0.25, 0.25]
    rows = sample_rows([p0, P1], [2], 5000)
    assert all(len(row) == 1 for row in rows)
    assert chi_square_p([row[0] for row in rows], p0) > 0.001


def test_the_chi_square_test_sees_a_sampler_that_keeps_the_draft_on_rejection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test above has the power to fail: resampling from the target with the rejected
    draft left in (no residual) over-emits the draft, and the p-value collapses."""
    monkeypatch.setattr(rejection, "_remove_drafts", lambda probs, rejected: probs)
    for draft in (2, 0):
        rows = sample_rows([P0, P1], [draft], NUM_SAMPLES)
        assert chi_square_p([row[0] for row in rows], P0) < 0.001


@pytest.mark.parametrize("drafts", [[2], [2, 1]], ids=["bonus", "second-draft"])
def test_the_second_token_given_the_first_has_the_next_positions_distribution(
    drafts: list[int],
) -> None:
    positions = [P0, P1, P2][: len(drafts) + 1]
    rows = sample_rows(positions, drafts, NUM_SAMPLES, seed=1)
    seconds = [row[1] for row in rows if row[0] == drafts[0]]
    assert len(seconds) > 0.25 * NUM_SAMPLES  # P0[2] = 0.3 of the rows accept the draft
    assert all(len(row) == 1 for row in rows if row[0] != drafts[0])  # a rejection ends a row
    assert chi_square_p(seconds, P1) > 0.001


def test_the_bonus_after_every_draft_has_the_last_positions_distribution() -> None:
    rows = sample_rows([P0, P1, P2], [2, 0], NUM_SAMPLES, seed=2)
    thirds = [row[2] for row in rows if row[:2] == [2, 0]]
    assert len(thirds) > 150  # 0.3 * 0.4 of the rows
    assert chi_square_p(thirds, P2) > 0.001


def test_a_mixed_batch_serves_each_row_from_its_own_positions() -> None:
    drafts = [[1, 2], [], [3], [0, 0, 0]]
    greedy = [True, False, True, False]
    argmax = torch.tensor([1, 4, 7] + [3, 5])  # rows 0 and 2: 2 + 1 and 1 + 1 positions
    one_hot = torch.eye(5)
    probs = torch.stack([one_hot[2]] + [one_hot[0]] * 3 + [one_hot[4]])  # rows 1 and 3
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    states = [g.get_state() for g in generators]
    out = rejection_sample(
        drafts, greedy, target_argmax=argmax, target_probs=probs, generators=generators
    )
    assert out == [[1, 4], [2], [3, 5], [0, 0, 0, 4]]
    for i in (0, 2):  # greedy rows draw nothing
        assert torch.equal(generators[i].get_state(), states[i])


def test_the_same_seeds_give_the_same_tokens() -> None:
    first = sample_rows([P0, P1, P2], [2, 1], 200, seed=7)
    assert sample_rows([P0, P1, P2], [2, 1], 200, seed=7) == first
    assert sample_rows([P0, P1, P2], [2, 1], 200, seed=8) != first


def test_a_residual_that_rounds_to_nothing_emits_the_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """p(d) below 1 only by rounding: when a draw still rejects d, the residual is empty,
    and the draft (what the target takes) is emitted, not an arbitrary token."""
    monkeypatch.setattr(rejection, "_uniforms", lambda count, generator: [1.0 - 2**-60] * count)
    p0 = [0.0, 0.0, 1.0 - 2**-24, 0.0, 0.0]
    assert sample_rows([p0, P1], [2], 3) == [[2]] * 3


def test_positions_must_match_the_drafts() -> None:
    with pytest.raises(ValueError, match="3 positions, expected 5"):
        rejection_sample([[1, 2], [3]], [True, True], target_argmax=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="target_probs is required"):
        rejection_sample([[1]], [False])
    with pytest.raises(ValueError, match="2 greedy flags for 1 rows"):
        rejection_sample([[1]], [True, False])
