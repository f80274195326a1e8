"""A step that verifies drafts, laid out as rows every attention path already runs.

A row that verifies k drafts needs logits at each of its k + 1 tokens, each attending to its
sequence's context up to itself. It becomes k + 1 one-token rows over the same block table,
row j at position `num_computed_tokens + j` with `j + 1` more keys than the row before it
(as cpu_paged's `per_token` sends every token to the decode kernel): the attention paths
write every row's K/V before attending, so row j reads the K/V rows 0..j-1 wrote. A decode
step that verifies drafts is then still all one-token rows, which the native decode stack
and the decode kernels run; the model's logits at each row's last token are then one per
position. Rows without drafts stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.batch import Batch
from schedulers.sequence import Sequence


@dataclass(frozen=True)
class FlatRows:
    """The rows of a step that verifies drafts: `seqs[r]` computes `token_ids[r]` from
    position `starts[r]`; `logits_rows`: the rows sampled from (every position of each
    verifying row), None: all."""

    seqs: list[Sequence]
    starts: list[int]
    num_scheduled_tokens: list[int]
    token_ids: list[list[int]]
    logits_rows: list[int] | None


def verify_rows(batch: Batch, rows: list[int] | None = None) -> FlatRows:
    """`batch` with each verifying row split into one row per token; `rows`: the batch rows
    sampled from (None: all), mapped to every row of theirs that gives logits."""
    seqs: list[Sequence] = []
    starts: list[int] = []
    counts: list[int] = []
    tokens: list[list[int]] = []
    first: list[int] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens, strict=True)):
        start = seq.num_computed_tokens
        first.append(len(seqs))
        drafts = batch.draft_token_ids.get(i)
        if not drafts:
            seqs.append(seq)
            starts.append(start)
            counts.append(n)
            tokens.append(seq.token_ids(start, start + n))
            continue
        own = seq.token_ids(start, start + n - len(drafts))  # its last sampled token
        for j, token in enumerate([*own, *drafts]):
            seqs.append(seq)
            starts.append(start + j)
            counts.append(1)
            tokens.append([token])
    logits_rows = None
    if rows is not None:
        widths = [1 + len(batch.draft_token_ids.get(i, ())) for i in rows]
        logits_rows = [first[i] + j for i, w in zip(rows, widths, strict=True) for j in range(w)]
    return FlatRows(seqs, starts, counts, tokens, logits_rows)
