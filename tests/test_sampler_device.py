"""The sampler as it runs on a GPU, checked on the CPU: top-p without host branches gives the
tokens the host-branching search gives (rows whose nucleus fits the sorted head and rows that
need the whole sort, in one batch), and the token counts kept per sequence and updated with
only the new tokens penalise exactly as a recount would."""

from __future__ import annotations

import torch

from backends.torch.sample.sampler import Sampler
from backends.torch.sample.token_counts import TokenCounts
from tests.test_sampler import CPU, make_seq, random_logits, tokens_of


def test_top_p_without_host_branches_picks_the_same_tokens() -> None:
    vocab = 4096
    flat = torch.linspace(0.0, -0.1, vocab)[None]  # a top_p=0.5 nucleus wider than the head
    host, device_like = Sampler(vocab, CPU), Sampler(vocab, CPU, host_branches=False)
    for step in range(5):
        peaked = random_logits(3, vocab, seed=step) * 2
        logits = torch.cat([peaked, flat, peaked[:1]])
        params = [dict(top_p=0.9), dict(top_p=0.5, top_k=50), dict(), dict(top_p=0.5),
                  dict(top_p=0.7, min_p=0.01)]  # fmt: skip
        seqs = [make_seq(seq_id=i, seed=10 * step + i, **p) for i, p in enumerate(params)]
        again = [make_seq(seq_id=i, seed=10 * step + i, **p) for i, p in enumerate(params)]
        assert tokens_of(device_like, logits, seqs) == tokens_of(host, logits, again)


def test_counts_follow_appended_tokens_and_restart_for_a_new_owner() -> None:
    counts = TokenCounts(6, CPU)
    a, b = make_seq(0), make_seq(1)
    tokens = [1, 1, 7, -1]  # ids outside the vocabulary are dropped
    assert counts.rows([(0, "output")], [tokens], [a]).tolist() == [[0, 2, 0, 0, 0, 0]]
    tokens += [5, 1]
    got = counts.rows([(0, "output"), (1, "all")], [tokens, [2, 2, 3]], [a, b])
    assert got.tolist() == [[0, 3, 0, 0, 0, 1], [0, 0, 2, 1, 0, 0]]
    other = make_seq(0)  # the same key, another sequence: counted afresh
    assert counts.rows([(0, "output")], [[4, 4, 4, 4, 4, 4, 4]], [other]).tolist() == [
        [0, 0, 0, 0, 7, 0]
    ]
    counts.release(0)
    counts.release(1)
    assert counts.rows([(3, "all")], [[0]], [make_seq(3)]).tolist() == [[1, 0, 0, 0, 0, 0]]


def test_penalties_over_growing_outputs_equal_a_fresh_sampler_each_step() -> None:
    vocab = 64
    penalties = dict(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4,
                     repetition_penalty=1.3, logprobs=3)  # fmt: skip
    kept = Sampler(vocab, CPU)
    seq = make_seq(0, **penalties)  # its output list is appended to, as in the engine
    for step in range(8):
        logits = random_logits(1, vocab, seed=step)
        fresh = make_seq(0, output=tuple(seq.output_token_ids), **penalties)
        got = kept(logits, [seq])[0]
        want = Sampler(vocab, CPU)(logits, [fresh])[0]
        assert (got.token_id, got.logprob, got.top) == (want.token_id, want.logprob, want.top)
        seq.output_token_ids.append(got.token_id)
