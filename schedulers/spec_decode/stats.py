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
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verified draft, the bonus included (None before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
