"""What bounds a sequence's drafts besides the policy: what it may still emit, and the budget."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from schedulers.sequence import Sequence


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
