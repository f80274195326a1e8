"""How many tokens each sequence drafts this step: the one object the scheduler asks.

Per step the scheduler calls `begin_step(num_decode_rows)` once; 0 means no sequence drafts
this step, and it asks nothing else. Otherwise it asks `draft_len(seq_id)` for each decoding
sequence (and bounds the answer by `budget.draft_room` and the token budget), and after the
step's verification reports each sequence's `observe(seq_id, num_draft_tokens,
num_accepted)`; a finished sequence is `release`d.
"""

from __future__ import annotations

import abc

from schedulers.spec_decode.acceptance import AcceptanceTracker
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.load_switch import LoadSwitch


class DraftPolicy(abc.ABC):
    """Sets each step's draft lengths (module docstring for the calling order)."""

    #: whether any sequence may ever draft (False: the scheduler need not count its rows)
    enabled: bool = True

    @abc.abstractmethod
    def begin_step(self, num_decode_rows: int) -> int:
        """Start a step with `num_decode_rows` decoding sequences; the most any of them
        drafts in it (0: none does)."""

    @abc.abstractmethod
    def draft_len(self, seq_id: int) -> int:
        """How many tokens `seq_id` drafts this step (at most `begin_step`'s answer)."""

    @abc.abstractmethod
    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        """`seq_id`'s verification this step accepted `num_accepted` of its drafts."""

    @abc.abstractmethod
    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""


class NoSpeculation(DraftPolicy):
    """Speculation off: every answer is 0, no state, nothing counted."""

    enabled = False

    def begin_step(self, num_decode_rows: int) -> int:
        return 0

    def draft_len(self, seq_id: int) -> int:
        return 0

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None


#: the policy of an arm without `--speculative-config`
NO_SPECULATION = NoSpeculation()


class SpeculationPolicy(DraftPolicy):
    """`num_speculative_tokens` per sequence, off above the load switch's threshold
    (load_switch.py); with `adaptive`, each sequence's own length from its acceptance
    (acceptance.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.switch = LoadSwitch.from_config(config)
        self.tracker = AcceptanceTracker(config) if config.adaptive else None
        self.step = 0
        self._cap = 0

    def begin_step(self, num_decode_rows: int) -> int:
        self.step += 1
        on = self.switch.update(num_decode_rows, self.step)
        self._cap = self.config.num_speculative_tokens if on else 0
        return self._cap

    def draft_len(self, seq_id: int) -> int:
        if self._cap == 0 or self.tracker is None:
            return self._cap
        return min(self._cap, self.tracker.draft_len(seq_id, self.step))

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        if self.tracker is not None:
            self.tracker.observe(seq_id, num_draft_tokens, num_accepted, self.step)

    def release(self, seq_id: int) -> None:
        if self.tracker is not None:
            self.tracker.release(seq_id)


def draft_policy(config: SpeculativeConfig | None) -> DraftPolicy:
    """The policy for an arm's `--speculative-config` (None: `NO_SPECULATION`)."""
    return NO_SPECULATION if config is None else SpeculationPolicy(config)
