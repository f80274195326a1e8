"""What bounds a sequence's drafts besides the policy: what it may still emit, the budget and
the backend's fast step size."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from schedulers.sequence import Sequence
from schedulers.spec_decode.thresholds import expected_accepted


def draft_room(seq: Sequence, max_model_len: int) -> int:
    """The most drafts worth verifying for decoding `seq` now.

    A verified step emits up to k + 1 tokens, so k stops one short of what `max_tokens`
    leaves (a longer draft could never be emitted); and the drafts' positions
    `num_tokens .. num_tokens + k - 1` stay inside the context window (vLLM's bound). Both
    keep every draft position inside the KV a policy reserves for prompt + `max_tokens`
    (static's worst case).
    """
    left = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(left, max_model_len - seq.num_tokens))


def allot_drafts(requested: Seq[int], spare: int) -> list[int]:
    """Draft lengths that fit `spare` tokens, granted in row order (a row's drafts are cut
    where the budget runs out, and the rows after it get none, as vLLM's scheduler does).

    `spare` is the step's token budget left after every row's own tokens (prefill chunks and
    each decoding row's one token), so drafts never take a decode's seat.
    """
    out: list[int] = []
    for want in requested:
        granted = max(0, min(want, spare))
        out.append(granted)
        spare -= granted
    return out


def fit_fast_rows(
    granted: Seq[int], plain_rows: int, fast_rows: int, speedup: float, p: float
) -> list[int]:
    """`granted` (each row's drafts), or fewer drafts so the step stays within `fast_rows`
    rows, whichever emits more tokens per unit of step time.

    A step of `plain_rows` rows (every row's own tokens) that fits the backend's fast
    kernels (`schedulers.backend.FastRows`) leaves them once its drafts take it past
    `fast_rows`: the step then costs `speedup` times more. The fitted drafts share the
    `fast_rows - plain_rows` spare rows one at a time, row after row (a row's first draft is
    worth more than another row's fourth). Each row's tokens are 1 + the expected accepted
    drafts at per-draft acceptance `p` (thresholds.py), so fitting wins when its tokens
    times `speedup` are at least the tokens of all `granted`.
    """
    drafted = plain_rows + sum(granted)
    if plain_rows > fast_rows or drafted <= fast_rows:
        return list(granted)
    fitted = [0] * len(granted)
    spare = fast_rows - plain_rows
    while spare:
        grew = False
        for i, want in enumerate(granted):
            if spare and fitted[i] < want:
                fitted[i] += 1
                spare -= 1
                grew = True
        if not grew:
            break
    full = sum(1 + expected_accepted(p, k) for k in granted)
    fit = sum(1 + expected_accepted(p, k) for k in fitted)
    return fitted if fit * speedup >= full else list(granted)
