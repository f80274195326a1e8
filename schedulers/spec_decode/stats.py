"""Speculative decoding's counters, in vLLM's names (`vllm:spec_decode_*`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """What verification has seen since the engine started (vLLM v1's `SpecDecodingStats`).

    A draft is one sequence's drafts in one step (a step it proposed none is not one);
    `num_accepted_tokens_per_pos[j]` counts the drafts whose token at position j was
    accepted (so position j is only reached when 0..j-1 were). The mean acceptance length
    (vLLM's, bonus token included) is `1 + num_accepted_tokens / num_drafts`.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    #: drafts cut short: a draft token was rejected (the rest were never looked at)
    num_rejected_drafts: int = 0

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verified step: `num_accepted` of its `num_draft_tokens` drafts."""
        if num_draft_tokens < 1:
            return
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"{num_accepted} accepted of {num_draft_tokens} drafts "
                f"(at most {self.num_speculative_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_rejected_drafts += num_accepted < num_draft_tokens
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verified draft, the bonus included (None before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def draft_acceptance(self, prior: tuple[float, float] = (4.0, 1.0)) -> float:
        """The chance a draft token is accepted once every one before it was: accepted tokens
        over accepted tokens plus rejections (each draft stops at its first rejected token,
        so this is the estimate for a per-position acceptance, the geometric model of
        thresholds.py), with `prior` (accepted, rejected) pseudo-counts added; 0.8 before any
        draft at the default."""
        accepted = self.num_accepted_tokens + prior[0]
        return accepted / (accepted + self.num_rejected_drafts + prior[1])
