"""A step that verified drafts: the tokens every row emits, from logits at each position.

The runner hands over one logits row per position sampled from: one for a row without drafts
(it is sampled as in any step, by the `Sampler` itself), `k + 1` for a row that verified k
drafts (position j: the target's distribution after its first j drafts). A verifying row's
positions get the sampler's processing (logit bias; such rows have no penalties and no
grammar: schedulers/spec_decode/drafter.py), then `rejection_sample` (rejection.py) picks
what it emits: greedy rows the argmax while it equals the draft, sampled rows by the
rejection rule over the temperature / top-k / top-p / min-p distribution the sampler would
draw from. A row's i-th emitted token gets its logprob (and top alternatives) at its
position i, from the biased logits before temperature, as the sampler reports them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence as Seq

import torch

from backends.torch.sample.rejection import rejection_sample
from backends.torch.sample.sampler import Sampler, _is_greedy
from schedulers.batch import Batch, ExecuteOutput
from schedulers.sequence import Sequence, TokenLogprob


def verify_step(
    sampler: Sampler, logits: torch.Tensor, batch: Batch, rows: list[int]
) -> ExecuteOutput:
    """The output of `batch`, whose rows `rows` are sampled from and whose `logits` hold one
    row per position of those (module docstring), in row order."""
    drafts = [batch.draft_token_ids.get(i, []) for i in rows]
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    plain = [j for j, d in enumerate(drafts) if not d]
    checks = [j for j, d in enumerate(drafts) if d]
    out = ExecuteOutput()
    if plain:
        index = torch.tensor([starts[j] for j in plain], device=logits.device)
        seqs = [batch.seqs[rows[j]] for j in plain]
        for seq, token in zip(seqs, sampler(logits[index], seqs), strict=True):
            out.sampled[seq.seq_id] = token
    if checks:
        positions = [p for j in checks for p in range(starts[j], starts[j + 1])]
        index = torch.tensor(positions, device=logits.device)
        seqs = [batch.seqs[rows[j]] for j in checks]
        emitted = verify_drafts(sampler, logits[index], seqs, [drafts[j] for j in checks])
        for seq, tokens in zip(seqs, emitted, strict=True):
            out.verified[seq.seq_id] = tokens
    return out


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: Seq[Seq[int]]
) -> list[list[TokenLogprob]]:
    """What each of `seqs` emits after verifying its `drafts` against `logits` [P, V], its
    `len(drafts[r]) + 1` positions after the previous row's."""
    params = [
        seq.sampling_params for seq, d in zip(seqs, drafts, strict=True) for _ in range(len(d) + 1)
    ]
    logits = sampler.biased(logits, params)  # [P, V] float32
    greedy = [_is_greedy(seq.sampling_params) for seq in seqs]
    at = [r for r, d in enumerate(drafts) for _ in range(len(d) + 1)]  # the row of each position
    greedy_pos = [p for p, r in enumerate(at) if greedy[r]]
    sampled_pos = [p for p, r in enumerate(at) if not greedy[r]]
    argmax = sampler.argmax(logits[_index(greedy_pos, logits)]) if greedy_pos else None
    probs = None
    if sampled_pos:
        index = _index(sampled_pos, logits)
        probs = sampler.target_probs(logits[index], [params[p] for p in sampled_pos])
    generators = [
        None if g else sampler.generator(seq) for seq, g in zip(seqs, greedy, strict=True)
    ]
    emitted = rejection_sample(
        drafts, greedy, target_argmax=argmax, target_probs=probs, generators=generators
    )
    return _with_logprobs(logits, seqs, drafts, emitted)


def _index(positions: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(positions, device=like.device)


def _with_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], drafts: Seq[Seq[int]], emitted: list[list[int]]
) -> list[list[TokenLogprob]]:
    """Each emitted token with its logprob and top alternatives at its own position, for the
    rows that ask (NaN and none for the others)."""
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    wanted = [r for r, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
    out = [[TokenLogprob(t, math.nan, []) for t in tokens] for tokens in emitted]
    if not wanted:
        return out
    positions = [starts[r] + i for r in wanted for i in range(len(emitted[r]))]
    tokens = [t for r in wanted for t in emitted[r]]
    log_probs = logits[_index(positions, logits)].log_softmax(dim=-1)  # [E, V]
    values = log_probs.gather(-1, _index(tokens, logits)[:, None]).squeeze(-1).tolist()
    k = min(max(seqs[r].sampling_params.logprobs or 0 for r in wanted), log_probs.shape[-1])
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0],) * 2
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    e = 0
    for r in wanted:
        n = seqs[r].sampling_params.logprobs or 0
        for i, token in enumerate(emitted[r]):
            top = list(zip(top_ids_list[e][:n], top_values_list[e][:n], strict=True))
            out[r][i] = TokenLogprob(token, values[e], top)
            e += 1
    return out
