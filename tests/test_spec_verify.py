"""backends/torch/sample/verify.py: a verified step's rows, from logits at every position.

A greedy row emits the argmax (after its logit bias) while it equals the draft; each emitted
token's logprob and top alternatives are the biased logits' log-softmax at its own position,
as the sampler reports a sampled token's; rows without drafts are the sampler's own.
"""

from __future__ import annotations

import math

import torch

from backends.torch.sample.sampler import Sampler
from backends.torch.sample.verify import verify_drafts, verify_step
from schedulers.batch import Batch
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

VOCAB = 50


def seq(seq_id: int, **params: object) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [1, 2, 3], SamplingParams(max_tokens=9, **params))  # type: ignore[arg-type]


def test_greedy_rows_emit_the_biased_argmax_with_its_logprobs_at_each_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4 + 3, VOCAB)  # row 0: 3 drafts; row 1: 2 drafts
    bias = {7: 5.0}
    first = seq(0, temperature=0.0, logprobs=2, logit_bias=bias)
    second = seq(1, temperature=0.0, logprobs=0)
    biased = logits.clone()
    biased[:4, 7] += 5.0
    argmax = biased.argmax(-1).tolist()
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % VOCAB], [(argmax[4] + 1) % VOCAB, 3]]
    sampler = Sampler(VOCAB, torch.device("cpu"), cpu_kernels=False)
    out = verify_drafts(sampler, logits, [first, second], drafts)
    assert [t.token_id for t in out[0]] == argmax[:3]  # two accepted, the argmax at the third
    assert [t.token_id for t in out[1]] == argmax[4:5]  # rejected at once
    log_probs = biased.log_softmax(-1)
    for row, start in ((0, 0), (1, 4)):
        for i, token in enumerate(out[row]):
            assert math.isclose(
                token.logprob, log_probs[start + i, token.token_id].item(), abs_tol=1e-5
            )
    assert [t for t, _ in out[0][1].top] == log_probs[1].topk(2).indices.tolist()
    assert out[1][0].top == []


def test_rows_without_drafts_are_the_samplers_and_verified_rows_are_listed_apart() -> None:
    torch.manual_seed(1)
    plain, checked = seq(0, temperature=0.0), seq(1, temperature=0.0)
    for s in (plain, checked):
        s.num_computed_tokens = 3
        s.output_token_ids.append(4)
    batch = Batch(0)
    batch.add(plain, 1)
    batch.add(checked, 1)
    logits = torch.randn(1 + 3, VOCAB)
    batch.add_drafts(1, logits[1:3].argmax(-1).tolist())  # both accepted: the bonus follows
    sampler = Sampler(VOCAB, torch.device("cpu"), cpu_kernels=False)
    out = verify_step(sampler, logits, batch, [0, 1])
    assert out.sampled[0].token_id == logits[0].argmax().item()
    assert [t.token_id for t in out.verified[1]] == logits[1:].argmax(-1).tolist()
    assert 1 not in out.sampled and 0 not in out.verified
    assert math.isnan(out.verified[1][0].logprob)
