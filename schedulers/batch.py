"""What one iteration runs (the scheduler's decision) and what the backend hands back."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedulers.sequence import Sequence, TokenLogprob


@dataclass
class Batch:
    """One iteration: each sequence with the number of tokens it computes this step.

    Sequence `seqs[i]` computes tokens at positions
    `[seqs[i].num_computed_tokens, seqs[i].num_computed_tokens + num_scheduled_tokens[i])`
    of its prompt + output; its block table already covers them. It is sampled from when
    that range reaches `seqs[i].num_tokens` (`samples_after[i]`); a chunked prefill that
    stops short is not.

    With speculative decoding, decoding row i may also verify `draft_token_ids[i]`: its
    scheduled tokens are its one own token and then those drafts (positions `num_tokens ..
    num_tokens + k - 1`, KV blocks allocated), and the backend samples at each of them
    (`ExecuteOutput.verified`). Without drafts the dict is empty.
    """

    iteration: int
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: tokens of sequences still catching up (prefill, chunked prefill or recompute)
    num_prefill_tokens: int = 0
    #: tokens of sequences computing just their last sampled token
    num_decode_tokens: int = 0
    #: tokens of the sequences admitted this step that the prefix cache served (not computed)
    num_cached_tokens: int = 0
    #: draft tokens each verifying row checks after its own token, by row index
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    #: draft tokens of the whole step (counted in `num_scheduled_tokens`, not as decodes)
    num_draft_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Schedule `num_tokens` of `seq` (classified now, before the step moves it on)."""
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        if seq.num_output_tokens and seq.num_tokens - seq.num_computed_tokens == 1:
            self.num_decode_tokens += num_tokens
        else:
            self.num_prefill_tokens += num_tokens

    def add_drafts(self, i: int, draft_token_ids: list[int]) -> None:
        """Row `i` (a decode) verifies `draft_token_ids` after its own token."""
        self.draft_token_ids[i] = draft_token_ids
        self.num_scheduled_tokens[i] += len(draft_token_ids)
        self.num_draft_tokens += len(draft_token_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples_after(self, i: int) -> bool:
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] >= seq.num_tokens


@dataclass
class ExecuteOutput:
    """One sampled token per sequence that completed its scheduled tokens, keyed by seq_id.

    A row that verified drafts is in `verified` instead: the tokens it emits, its accepted
    drafts and then the target's own token (1 to k + 1). `Scheduler.update` cuts such a list
    after the token that finished its sequence, so it holds what the sequence took.
    """

    sampled: dict[int, TokenLogprob] = field(default_factory=dict)
    verified: dict[int, list[TokenLogprob]] = field(default_factory=dict)
