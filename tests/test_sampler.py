"""Sampler behaviour: greedy, seeded sampling, top-k / top-p / min-p, penalties, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends.torch.sample.sampler import Sampler, _inverse_cdf
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

CPU = torch.device("cpu")


def make_seq(
    seq_id: int = 0,
    prompt: tuple[int, ...] = (1, 2, 3),
    output: tuple[int, ...] = (),
    index: int = 0,
    **params: Any,
) -> Sequence:
    """A Sequence with the given tokens and SamplingParams(**params)."""
    return Sequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        index=index,
        output_token_ids=list(output),
    )


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Reproducible float32 logits [rows, vocab]."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def tokens_of(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The token ids `sampler` picks for `seqs`."""
    return [out.token_id for out in sampler(logits, seqs)]


def draws(logits_row: list[float], num: int = 400, **params: Any) -> list[int]:
    """Token ids drawn from one logits row by `num` differently seeded sequences."""
    logits = torch.tensor([logits_row] * num)
    seqs = [make_seq(seq_id=i, seed=i, **params) for i in range(num)]
    return tokens_of(Sampler(len(logits_row), CPU), logits, seqs)


def draw_many(logits_row: list[float], num: int = 400, **params: Any) -> set[int]:
    """The set of token ids `draws` yields."""
    return set(draws(logits_row, num, **params))


def test_greedy_picks_argmax() -> None:
    logits = random_logits(6, 50, seed=0)
    seqs = [make_seq(seq_id=i, temperature=0.0) for i in range(6)]
    assert tokens_of(Sampler(50, CPU), logits, seqs) == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_batch_keeps_greedy_rows_exact() -> None:
    logits = random_logits(6, 50, seed=1)
    seqs = [make_seq(seq_id=i, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    tokens = tokens_of(Sampler(50, CPU), logits, seqs)
    assert tokens[1::2] == logits.argmax(-1).tolist()[1::2]


def test_seeded_sampling_does_not_depend_on_batch_mates() -> None:
    vocab, steps = 512, 8
    params = dict(seed=1234, temperature=0.9, top_k=40, top_p=0.8, logprobs=3)
    alone_seq = make_seq(seq_id=7, **params)
    batched_seq = make_seq(seq_id=7, **params)
    mates = [
        make_seq(seq_id=100, temperature=0.0),
        make_seq(seq_id=101, seed=1, temperature=1.5),
        make_seq(seq_id=102, temperature=0.7),  # unseeded
        make_seq(seq_id=103, seed=1234, temperature=1.0, presence_penalty=1.0),
        make_seq(seq_id=104, seed=5, min_p=0.1, frequency_penalty=0.5, logprobs=20),
        make_seq(seq_id=105, seed=6, repetition_penalty=1.3, logit_bias={3: 5.0}),
        make_seq(seq_id=106, seed=7, top_k=2),
        make_seq(seq_id=107, seed=8, top_k=300, top_p=0.5),
    ]
    alone, batched = Sampler(vocab, CPU), Sampler(vocab, CPU)
    alone_out, batched_out = [], []
    for step in range(steps):
        # bf16-rounded logits, as a bf16 model gives: many ties around the top-k/top-p cut
        row = random_logits(1, vocab, seed=step).bfloat16().float()
        out = alone(row, [alone_seq])[0]
        alone_seq.output_token_ids.append(out.token_id)
        alone_out.append(out)
        # the sequence moves around the batch; mates get other logits every step
        position = step % 8
        mates_now = mates[: 1 + step % len(mates)]  # batch size, and so sort width, varies
        seqs = mates_now[:position] + [batched_seq] + mates_now[position:]
        position = seqs.index(batched_seq)
        logits = random_logits(len(seqs), vocab, seed=1000 + step)
        logits[position] = row[0]
        outs = batched(logits, seqs)
        for seq, mate_out in zip(seqs, outs, strict=True):
            seq.output_token_ids.append(mate_out.token_id)
        batched_out.append(outs[position])
    assert [o.token_id for o in alone_out] == [o.token_id for o in batched_out]
    assert [o.top for o in alone_out] == [o.top for o in batched_out]
    assert len({o.token_id for o in alone_out}) > 1


def sample_steps(seed: int | None, index: int = 0, steps: int = 10, vocab: int = 1000) -> list[int]:
    """Tokens a fresh sampler draws for one sequence over `steps` flat-logits steps."""
    sampler = Sampler(vocab, CPU)
    seq = make_seq(seq_id=0, seed=seed, index=index)
    return [tokens_of(sampler, torch.zeros(1, vocab), [seq])[0] for _ in range(steps)]


def test_same_seed_repeats_and_different_seeds_differ() -> None:
    assert sample_steps(seed=42) == sample_steps(seed=42)
    assert sample_steps(seed=42) != sample_steps(seed=43)
    assert sample_steps(seed=None) != sample_steps(seed=None)


def test_release_forgets_the_generator() -> None:
    sampler = Sampler(1000, CPU)
    seq = make_seq(seq_id=3, seed=9)
    logits = torch.zeros(1, 1000)
    first = [tokens_of(sampler, logits, [seq])[0] for _ in range(5)]
    continued = [tokens_of(sampler, logits, [seq])[0] for _ in range(5)]
    sampler.release(3)
    restarted = [tokens_of(sampler, logits, [seq])[0] for _ in range(5)]
    assert restarted == first
    assert continued != first
    sampler.release(3)
    sampler.release(12345)  # unknown ids are ignored


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_follows_the_tempered_distribution(temperature: float) -> None:
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    num = 4000
    counts = torch.bincount(torch.tensor(draws(row, num, temperature=temperature)), minlength=4)
    expected = (torch.tensor(row) / temperature).softmax(-1) * num
    sigma = (expected * (1 - expected / num)).sqrt()
    assert ((counts - expected).abs() < 4 * sigma).all(), (counts, expected)


def test_top_k_keeps_logits_tied_with_the_kth() -> None:
    assert draw_many([3.0, 2.0, 2.0, 2.0, 1.0], top_k=2) == {0, 1, 2, 3}


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(8, 100, seed=2)
    seqs = [make_seq(seq_id=i, seed=i, top_k=1, temperature=1.5) for i in range(8)]
    assert tokens_of(Sampler(100, CPU), logits, seqs) == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_top_k() -> None:
    row = random_logits(1, 20, seed=3)[0] / 3  # fairly flat
    top5 = set(row.topk(5).indices.tolist())
    drawn = draw_many(row.tolist(), top_k=5, temperature=2.0)
    assert drawn == top5


def test_rows_with_different_top_k_and_top_p_are_filtered_separately() -> None:
    row = random_logits(1, 20, seed=8)[0] / 3
    ranked = row.argsort(descending=True).tolist()
    logits = row.expand(300, 20)
    filters = [dict(top_k=2), dict(top_k=6), dict(top_p=0.999)]
    seqs = [make_seq(seq_id=i, seed=i, temperature=2.0, **filters[i % 3]) for i in range(300)]
    tokens = tokens_of(Sampler(20, CPU), logits, seqs)
    assert set(tokens[0::3]) == set(ranked[:2])
    assert set(tokens[1::3]) == set(ranked[:6])
    assert len(set(tokens[2::3])) > 6


def test_top_p_keeps_exactly_the_nucleus() -> None:
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert draw_many(row, top_p=0.8) == {0, 1}
    assert draw_many(row, top_p=0.81) == {0, 1, 2}
    assert draw_many(row, top_p=0.95) == {0, 1, 2}
    assert draw_many(row, top_p=0.01) == {0}
    assert draw_many(row[::-1], top_p=1e-9) == {3}


def test_top_p_applies_to_the_distribution_renormalized_over_the_top_k() -> None:
    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert draw_many(row, top_p=0.55) == {0, 1}
    assert draw_many(row, top_k=2, top_p=0.55) == {0}  # 0.4 / 0.7 = 0.57 reaches 0.55
    assert draw_many(row, top_k=3, top_p=0.75) == {0, 1}  # 0.7 / 0.9 = 0.78
    assert draw_many(row, top_k=3, top_p=0.8) == {0, 1, 2}


def test_a_nucleus_wider_than_the_sorted_head_is_not_truncated() -> None:
    row = torch.linspace(0.0, -0.1, 4000, dtype=torch.float64)  # nearly flat
    probs = row.softmax(-1)
    nucleus_size = int(((probs.cumsum(-1) - probs) < 0.5).sum())
    assert nucleus_size > 1024
    drawn = draw_many(row.tolist(), top_p=0.5)
    assert max(drawn) < nucleus_size
    assert max(drawn) > 1024


def test_rows_without_filters_are_not_cut_to_a_mates_sorted_head() -> None:
    vocab = 4096
    peaked = random_logits(1, vocab, seed=9) * 3  # its top_p=0.9 nucleus fits the head
    flat = torch.linspace(0.0, -0.1, vocab).expand(200, vocab)  # distinct, nearly flat
    logits = torch.cat([peaked, flat])
    seqs = [make_seq(seq_id=0, seed=0, top_p=0.9)]
    seqs += [make_seq(seq_id=i, seed=i) for i in range(1, 201)]
    tokens = tokens_of(Sampler(vocab, CPU), logits, seqs)
    assert max(tokens[1:]) > 1024


def test_top_p_gives_the_same_tokens_whether_or_not_a_batch_mate_forces_a_full_sort() -> None:
    vocab = 4096
    flat = torch.zeros(1, vocab)  # top_p=0.99 over it needs more than the sorted head
    alone, batched = Sampler(vocab, CPU), Sampler(vocab, CPU)
    for step in range(6):
        row = (random_logits(1, vocab, seed=step) * 2).bfloat16().float()
        seqs = [make_seq(seq_id=i, seed=i, top_p=0.9) for i in range(4)]
        mate = make_seq(seq_id=99, seed=99, top_p=0.99)
        expected = tokens_of(alone, row.expand(4, vocab), seqs)
        got = tokens_of(batched, torch.cat([row.expand(4, vocab), flat]), seqs + [mate])
        assert got[:4] == expected


def test_top_p_stops_at_an_exact_boundary_despite_float_rounding() -> None:
    # in float32 the first token's share comes out a hair below 0.3
    row = [math.log(p) for p in (0.3, 0.25, 0.25, 0.2)]
    assert draw_many(row, top_p=0.3) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_prob() -> None:
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert draw_many(row, min_p=0.2) == {0, 1, 2}  # threshold 0.1
    assert draw_many(row, min_p=0.5) == {0, 1}  # threshold 0.25
    assert draw_many(row) == {0, 1, 2, 3}


def test_inverse_cdf_never_picks_a_zero_probability_token_at_the_edges() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 4)
    uniforms = [0.0, 0.5, math.nextafter(1.0, 0.0), 1.0]
    assert _inverse_cdf(probs, uniforms).tolist() == [1, 2, 2, 2]


def greedy_token(logits_row: list[float], seq: Sequence) -> int:
    """The token a fresh sampler picks for `seq` from one logits row."""
    return tokens_of(Sampler(len(logits_row), CPU), torch.tensor([logits_row]), [seq])[0]


def full_logprobs(logits_row: list[float], seq: Sequence) -> torch.Tensor:
    """The logprob the sampler reports for every token id (vocab <= 20), as a tensor [V]."""
    out = Sampler(len(logits_row), CPU)(torch.tensor([logits_row]), [seq])[0]
    values = dict(out.top)
    return torch.tensor([values[i] for i in range(len(logits_row))])


ROW = [2.0, 1.5, 0.0, -1.0]


def test_presence_penalty_counts_each_output_token_once() -> None:
    assert greedy_token(ROW, make_seq(output=(0,), temperature=0.0, presence_penalty=1.0)) == 1
    assert greedy_token(ROW, make_seq(output=(0,), temperature=0.0, presence_penalty=0.4)) == 0
    twice = make_seq(output=(0, 0), temperature=0.0, presence_penalty=0.4, logprobs=4)
    assert greedy_token(ROW, twice) == 0
    expected = torch.tensor([[1.6, 1.5, 0.0, -1.0]]).log_softmax(-1)[0]
    torch.testing.assert_close(full_logprobs(ROW, twice), expected)


def test_frequency_penalty_scales_with_the_count() -> None:
    assert greedy_token(ROW, make_seq(output=(0,), temperature=0.0, frequency_penalty=0.3)) == 0
    assert greedy_token(ROW, make_seq(output=(0, 0), temperature=0.0, frequency_penalty=0.3)) == 1
    seq = make_seq(output=(0, 0, 3), temperature=0.0, frequency_penalty=0.3, logprobs=4)
    expected = torch.tensor([[1.4, 1.5, 0.0, -1.3]]).log_softmax(-1)[0]
    torch.testing.assert_close(full_logprobs(ROW, seq), expected)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    seq = make_seq(prompt=(0, 0, 0), temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert greedy_token(ROW, seq) == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    assert greedy_token(ROW, make_seq(prompt=(0,), temperature=0.0, repetition_penalty=1.5)) == 1
    seq = make_seq(prompt=(2,), output=(0,), temperature=0.0, repetition_penalty=1.5)
    assert greedy_token(ROW, seq) == 1
    negative = [-1.0, -1.2, -5.0, -6.0]
    assert greedy_token(negative, make_seq(prompt=(0,), temperature=0.0)) == 0
    seq = make_seq(prompt=(0,), temperature=0.0, repetition_penalty=1.5)
    assert greedy_token(negative, seq) == 1
    seq = make_seq(prompt=(0, 3, 99), output=(0,), repetition_penalty=2.0, logprobs=4)
    expected = torch.tensor([[1.0, 1.5, 0.0, -2.0]]).log_softmax(-1)[0]
    torch.testing.assert_close(full_logprobs(ROW, seq), expected)


def test_penalties_leave_rows_without_them_untouched() -> None:
    logits = torch.tensor([ROW, ROW])
    seqs = [
        make_seq(seq_id=0, output=(0,), temperature=0.0, presence_penalty=2.0, logprobs=4),
        make_seq(seq_id=1, output=(0,), temperature=0.0, logprobs=4),
    ]
    penalized, plain = Sampler(4, CPU)(logits, seqs)
    assert (penalized.token_id, plain.token_id) == (1, 0)
    assert plain.logprob == pytest.approx(torch.tensor(ROW).log_softmax(-1)[0].item())


def test_logit_bias_flips_the_argmax_and_ignores_ids_outside_the_vocab() -> None:
    assert greedy_token(ROW, make_seq(temperature=0.0, logit_bias={1: 1.0})) == 1
    assert greedy_token(ROW, make_seq(temperature=0.0, logit_bias={0: -100.0})) == 1
    assert greedy_token(ROW, make_seq(temperature=0.0, logit_bias={4: 100.0, -1: 100.0})) == 0
    seq = make_seq(logit_bias={3: 4.0}, logprobs=4)
    expected = torch.tensor([[2.0, 1.5, 0.0, 3.0]]).log_softmax(-1)[0]
    torch.testing.assert_close(full_logprobs(ROW, seq), expected)


def test_logprobs_are_the_log_softmax_before_temperature() -> None:
    logits = random_logits(4, 20, seed=4)
    expected = logits.log_softmax(-1)
    seqs = [make_seq(seq_id=i, seed=i, temperature=0.5, top_k=3, logprobs=5) for i in range(4)]
    for row, out in enumerate(Sampler(20, CPU)(logits, seqs)):
        assert out.logprob == pytest.approx(expected[row, out.token_id].item(), abs=1e-5)
        assert len(out.top) == 5
        assert [lp for _, lp in out.top] == sorted((lp for _, lp in out.top), reverse=True)
        top = expected[row].topk(5)
        assert [i for i, _ in out.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in out.top]), top.values)


def test_full_logprobs_sum_to_one() -> None:
    seq = make_seq(logprobs=20, presence_penalty=0.5, output=(1, 2))
    out = Sampler(20, CPU)(random_logits(1, 20, seed=5), [seq])[0]
    assert len(out.top) == 20
    assert sum(math.exp(lp) for _, lp in out.top) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_are_computed_only_for_the_rows_that_ask() -> None:
    logits = random_logits(4, 30, seed=6)
    seqs = [
        make_seq(seq_id=0, temperature=0.0),
        make_seq(seq_id=1, seed=1, logprobs=0),
        make_seq(seq_id=2, seed=2),
        make_seq(seq_id=3, temperature=0.0, logprobs=2),
    ]
    outs = Sampler(30, CPU)(logits, seqs)
    expected = logits.log_softmax(-1)
    assert [out.token_id for out in outs][::3] == logits[::3].argmax(-1).tolist()
    for row in (0, 2):
        assert math.isnan(outs[row].logprob) and outs[row].top == []
    for row in (1, 3):
        want = expected[row, outs[row].token_id].item()
        assert outs[row].logprob == pytest.approx(want, abs=1e-5)
    assert outs[1].top == [] and len(outs[3].top) == 2


@pytest.mark.parametrize("temperature", [1e-4, 1e-30])
def test_temperature_near_zero_matches_greedy(temperature: float) -> None:
    logits = random_logits(8, 100, seed=7)
    seqs = [make_seq(seq_id=i, seed=i, temperature=temperature, logprobs=0) for i in range(8)]
    outs = Sampler(100, CPU)(logits, seqs)
    assert [out.token_id for out in outs] == logits.argmax(-1).tolist()
    assert all(math.isfinite(out.logprob) for out in outs)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        dict(top_p=0.5, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0),
        dict(logit_bias={0: 100.0, 1: -100.0}),
    ],
)
def test_masked_tokens_give_no_nans_and_are_never_sampled(params: dict[str, Any]) -> None:
    logits = torch.full((16, 20), -math.inf)
    logits[:, 5:8] = torch.tensor([1.0, 0.5, -0.5])
    seqs = [
        make_seq(seq_id=i, seed=i, prompt=(0, 5), output=(1, 6), logprobs=10, **params)
        for i in range(16)
    ]
    for out in Sampler(20, CPU)(logits, seqs):
        assert out.token_id in {5, 6, 7}
        assert math.isfinite(out.logprob)
        assert len(out.top) == 10
        assert not any(math.isnan(lp) for _, lp in out.top)


def test_bf16_and_padded_vocab_logits() -> None:
    logits = torch.zeros(64, 12, dtype=torch.bfloat16)
    logits[:, 10:] = 50.0  # padding columns beyond vocab_size
    seqs = [make_seq(seq_id=i, seed=i, temperature=0.0 if i == 0 else 1.0) for i in range(64)]
    tokens = tokens_of(Sampler(10, CPU), logits, seqs)
    assert all(0 <= token < 10 for token in tokens)
    assert len(set(tokens)) > 1


@pytest.mark.parametrize("extra", [{}, {"logprobs": 0}, {"presence_penalty": 0.0}])
def test_greedy_over_bf16_logits_is_the_argmax_of_their_fp32_values(extra: dict[str, Any]) -> None:
    """All-greedy rows take their argmax in the model's dtype (no fp32 copy): the same first
    index of the maximum as over the widened logits, with ties, padding columns and a NaN."""
    logits = (random_logits(16, 40, seed=11) * 4).round().to(torch.bfloat16)  # many ties
    logits[:, 30:] = 1e4  # padding beyond vocab_size
    logits[3, 7] = math.nan  # a NaN counts as the maximum, as in torch.argmax
    seqs = [make_seq(seq_id=i, temperature=0.0, **extra) for i in range(16)]
    want = logits[:, :30].float().argmax(dim=-1).tolist()
    assert want[3] == 7 and len(set(want)) > 1
    for cpu_kernels in (True, False):
        assert tokens_of(Sampler(30, CPU, cpu_kernels=cpu_kernels), logits, seqs) == want


def test_leaves_the_callers_logits_untouched() -> None:
    logits = random_logits(3, 20, seed=10)
    before = logits.clone()
    seqs = [
        make_seq(seq_id=0, temperature=0.0, logit_bias={1: 50.0}),
        make_seq(seq_id=1, seed=1, output=(2,), presence_penalty=2.0, top_p=0.5),
        make_seq(seq_id=2, seed=2, repetition_penalty=2.0, top_k=3, min_p=0.2),
    ]
    Sampler(20, CPU)(logits, seqs)
    assert torch.equal(logits, before)


def test_rejects_a_row_count_mismatch_and_accepts_an_empty_batch() -> None:
    sampler = Sampler(10, CPU)
    assert sampler(torch.zeros(0, 10), []) == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [make_seq()])
