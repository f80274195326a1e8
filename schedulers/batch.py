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

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Schedule `num_tokens` of `seq` (classified now, before the step moves it on)."""
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        if seq.num_output_tokens and seq.num_tokens - seq.num_computed_tokens == 1:
            self.num_decode_tokens += num_tokens
        else:
            self.num_prefill_tokens += num_tokens

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
    """One sampled token per sequence that completed its scheduled tokens, keyed by seq_id."""

    sampled: dict[int, TokenLogprob] = field(default_factory=dict)
