"""The rejection sampler of a verified step: which drafts each row accepts, and what follows.

vLLM v1's rejection sampler (vllm/v1/sample/rejection_sampler.py) for drafts that come
without probabilities (prompt lookup: a one-hot proposal, q(d) = 1), after Leviathan et al.
(arXiv 2211.17192). Row r verified `k_r` drafts at `k_r + 1` positions: position j holds the
target's distribution for the token after the row's last token and its first j drafts.

- A greedy row accepts drafts while each equals the target's argmax at its position, and
  emits the argmax at the first mismatch (or, all accepted, at the last position: the bonus
  token). Its output is token for token what decoding one token per step would give.
- A sampled row accepts draft d at position j with probability p_j(d) (draw u, accept when
  u < p_j(d)). At the first rejection it emits a token drawn from p_j with d removed and
  renormalised; all accepted, the bonus token drawn from p_k. The emitted tokens then have
  exactly the target's distribution: P(first = d) = p(d), and for x != d,
  P(first = x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x).

The target's distributions are the sampler's own (backends/torch/sample/sampler.py): the
caller applies bias, penalties, the grammar, temperature, top-k, top-p and min-p to each
position's logits and hands over the argmax (greedy rows) or the softmax (sampled rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def rejection_sample(
    draft_token_ids: Sequence[Sequence[int]],
    greedy: Sequence[bool],
    *,
    target_argmax: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[list[int]]:
    """The tokens each row emits: its accepted drafts, then one token of the target's.

    `draft_token_ids[r]`: row r's drafts (any number, 0 included: the row then just samples
    its one position). `greedy[r]`: whether row r takes the argmax. Positions are laid out
    row after row, `k_r + 1` per row, and each tensor holds only the positions of the rows it
    serves: `target_argmax` (G,) the greedy rows' argmax ids, `target_probs` (M, V) the
    sampled rows' processed probabilities. `generators[r]`: row r's generator (None: torch's
    default); a sampled row draws `k_r + 1` float64 uniforms from it, whatever it accepts,
    and a greedy row draws none.

    Row r emits between 1 and `k_r + 1` tokens; its i-th emitted token is the target's choice
    at its position i (so its logprob is read at that position).
    """
    num_rows = len(draft_token_ids)
    if len(greedy) != num_rows:
        raise ValueError(f"{len(greedy)} greedy flags for {num_rows} rows")
    greedy_rows = [r for r in range(num_rows) if greedy[r]]
    sampled_rows = [r for r in range(num_rows) if not greedy[r]]
    emitted: list[list[int]] = [[] for _ in range(num_rows)]
    if greedy_rows:
        drafts = [draft_token_ids[r] for r in greedy_rows]
        argmax = _positions(target_argmax, drafts, "argmax")
        for r, row in zip(greedy_rows, _greedy(drafts, argmax), strict=True):
            emitted[r] = row
    if sampled_rows:
        drafts = [draft_token_ids[r] for r in sampled_rows]
        probs = _positions(target_probs, drafts, "probs")
        gens = [None if generators is None else generators[r] for r in sampled_rows]
        for r, row in zip(sampled_rows, _sample(drafts, probs, gens), strict=True):
            emitted[r] = row
    return emitted


def _positions(tensor: torch.Tensor | None, drafts: list[Sequence[int]], name: str) -> torch.Tensor:
    """`tensor`, checked to hold one row per position of the rows with `drafts`."""
    expected = sum(len(d) + 1 for d in drafts)
    if tensor is None:
        raise ValueError(f"target_{name} is required for those rows ({expected} positions)")
    if tensor.shape[0] != expected:
        raise ValueError(f"target_{name} has {tensor.shape[0]} positions, expected {expected}")
    return tensor


def _greedy(drafts: list[Sequence[int]], argmax: torch.Tensor) -> list[list[int]]:
    """Each greedy row's tokens: the argmax while it equals the draft, then one more."""
    targets = argmax.tolist()
    out: list[list[int]] = []
    start = 0
    for row_drafts in drafts:
        row = targets[start : start + len(row_drafts) + 1]
        start += len(row_drafts) + 1
        accepted = next((j for j, d in enumerate(row_drafts) if row[j] != d), len(row_drafts))
        out.append(row[: accepted + 1])
    return out


def _sample(
    drafts: list[Sequence[int]],
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """Each sampled row's tokens (module docstring): accept while u < p(d), then draw from
    the residual at the first rejection, or the bonus token from the last position."""
    offsets = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))[:-1]
    uniforms = [_uniforms(len(d) + 1, g) for d, g in zip(drafts, generators, strict=True)]
    draft_probs = _draft_probs(drafts, offsets, probs)
    accepted = [
        next((j for j, d in enumerate(row) if not u[j] < p[j]), len(row))
        for row, u, p in zip(drafts, uniforms, draft_probs, strict=True)
    ]
    final = torch.tensor(
        [o + a for o, a in zip(offsets, accepted, strict=True)], device=probs.device
    )
    rejected = [
        (i, row[a]) for i, (row, a) in enumerate(zip(drafts, accepted, strict=True)) if a < len(row)
    ]
    residual = _remove_drafts(probs[final].to(torch.float64), rejected)  # (R, V)
    last = [u[-1] for u in uniforms]
    tokens, empty = _inverse_cdf(residual, last)
    for i, draft in rejected:
        if empty[i]:  # p(d) rounds to 1: nothing else to draw, and d is what it would take
            tokens[i] = draft
    return [list(row[:a]) + [token] for row, a, token in zip(drafts, accepted, tokens, strict=True)]


def _uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    """`count` uniforms in [0, 1) from the row's generator (float64, as the sampler draws)."""
    uniforms: list[float] = torch.rand(count, dtype=torch.float64, generator=generator).tolist()
    return uniforms


def _draft_probs(
    drafts: list[Sequence[int]], offsets: list[int], probs: torch.Tensor
) -> list[list[float]]:
    """p_j(d_j) of every draft, row by row (one gather, one copy to the host); `offsets[r]`
    is row r's first position."""
    positions = [o + j for o, row in zip(offsets, drafts, strict=True) for j in range(len(row))]
    if not positions:
        return [[] for _ in drafts]
    tokens = [d for row in drafts for d in row]
    index = torch.tensor(positions, device=probs.device), torch.tensor(tokens, device=probs.device)
    flat = probs[index].tolist()
    starts = itertools.accumulate((len(row) for row in drafts), initial=0)
    return [flat[start : start + len(row)] for start, row in zip(starts, drafts, strict=False)]


def _remove_drafts(probs: torch.Tensor, rejected: list[tuple[int, int]]) -> torch.Tensor:
    """`probs` (R, V) with each rejected row's draft token given probability 0 (in place):
    the residual max(p - q, 0) for a one-hot q, renormalised by the draw (`_inverse_cdf`)."""
    if rejected:
        rows, tokens = zip(*rejected, strict=True)
        index = torch.tensor(rows, device=probs.device), torch.tensor(tokens, device=probs.device)
        probs[index] = 0.0
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> tuple[list[int], list[bool]]:
    """One token per row of unnormalised `probs` (R, V) float64: the first whose cumulative
    mass exceeds uniforms[r] times the row's total (as the sampler draws), and whether the
    row's total was 0 (its token is then meaningless)."""
    cdf = probs.cumsum(dim=-1)  # (R, V)
    total = cdf[:, -1:].contiguous()  # (R, 1)
    target = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * total
    tokens = torch.searchsorted(cdf, target, right=True)  # (R, 1)
    # NOTE: rounding can make target == total; cap at the last token with nonzero mass
    tokens = torch.minimum(tokens, torch.searchsorted(cdf, total, right=False))
    return tokens.squeeze(-1).tolist(), (total.squeeze(-1) <= 0).tolist()
