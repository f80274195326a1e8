"""Speculative decoding's counters per arm, in vLLM's names (`vllm:spec_decode_*` as
`carousel_spec_decode_*`, labelled `model` and `arm` like every engine series).

Registered only once an arm with `--speculative-config` is watched, so a gateway without
speculation exports exactly what it did before. The mean acceptance length (vLLM's, the bonus
token included) is `1 + accepted_tokens / drafts` over any window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:
    from schedulers.outputs import IterationRecord
    from schedulers.spec_decode.stats import SpecDecodingStats

LABELS = ("model", "arm")


class SpecDecodeCounters:
    """The counter families, fed per arm by `listener`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=registry)

        self.drafts = counter(
            "carousel_spec_decode_num_drafts", "Rows that verified drafts (one per row per step)"
        )
        self.draft_tokens = counter(
            "carousel_spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.accepted_tokens = counter(
            "carousel_spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.accepted_per_pos = counter(
            "carousel_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            ("position",),
        )

    def listener(
        self, stats: SpecDecodingStats, model: str, arm: str
    ) -> Callable[[IterationRecord], None]:
        """An iteration listener adding each verified step of the arm whose drafter counts
        `stats` (read on the engine thread, after the step)."""
        drafts = self.drafts.labels(model, arm)
        draft_tokens = self.draft_tokens.labels(model, arm)
        accepted = self.accepted_tokens.labels(model, arm)
        per_pos = [
            self.accepted_per_pos.labels(model, arm, str(p))
            for p in range(stats.num_speculative_tokens)
        ]
        seen = list(stats.num_accepted_tokens_per_pos)

        def on_iteration(record: IterationRecord) -> None:
            if not record.num_drafts:
                return
            drafts.inc(record.num_drafts)
            draft_tokens.inc(record.num_draft_tokens)
            accepted.inc(record.num_accepted_tokens)
            now = stats.num_accepted_tokens_per_pos
            for p, child in enumerate(per_pos):
                if now[p] != seen[p]:
                    child.inc(now[p] - seen[p])
                    seen[p] = now[p]

        return on_iteration
