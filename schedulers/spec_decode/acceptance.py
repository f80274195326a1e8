"""Each sequence's draft length from its measured acceptance: SGLang's EMA ladder, per sequence.

SGLang's `--speculative-adaptive` (python/sglang/srt/speculative/adaptive_spec_params.py)
keeps an EMA of the draft tokens accepted per verified step and moves the draft length one
rung at a time: up from k when the EMA exceeds `k - 0.5 + up_hysteresis`, down to k - 1 when
it falls to `k - 1.5 + down_hysteresis`, and from 1 to 0 at `0.5 + down_hysteresis`. It does
so for the whole batch; here each sequence has its own ladder (prompt lookup pays on the
request that copies its prompt, not on its neighbour), and a sequence at 0 is re-probed
after a backoff instead of staying off.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.spec_decode.config import SpeculativeConfig


@dataclass
class SequenceAcceptance:
    """One sequence's acceptance state.

    `k` is the draft length it has earned (0: backing off until step `probe_at`); `ema` the
    EMA of its accepted draft tokens per verified step; `backoff` the steps of its last
    backoff (0: none failed since it last had a draft accepted); `probing` whether its next
    verified step is a probe.
    """

    k: int
    ema: float
    probe_at: int = 0
    backoff: int = 0
    probing: bool = False


class AcceptanceTracker:
    """Draft lengths per sequence, from the acceptance each one has shown.

    A new sequence starts trusted: k = `num_speculative_tokens` and an EMA as if every draft
    had been accepted. `observe` feeds each verified step (steps with no draft say nothing
    about acceptance and are skipped) and moves k along the ladder (module docstring); down
    moves are checked first, and a step that moves down never moves up. When k reaches 0 the
    sequence drafts nothing for `probe_backoff_steps` steps, then drafts one token with its
    EMA at the 1 -> 0 threshold: an accepted probe keeps it on (and clears the backoff), a
    rejected one turns it off again for twice as long, at most `max_probe_backoff_steps`.

    The knobs' defaults and how they stand against the measured break-even acceptance of
    each draft length are in config.py (`SpeculativeConfig`, MEASURED_BASIS).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_k = config.num_speculative_tokens
        self.alpha = config.ema_alpha
        self.up = config.up_hysteresis
        self.down = config.down_hysteresis
        self.first_backoff = config.probe_backoff_steps
        self.max_backoff = config.max_probe_backoff_steps
        self._states: dict[int, SequenceAcceptance] = {}

    @property
    def off_threshold(self) -> float:
        """The EMA at or below which a sequence drafting one token stops drafting."""
        return 0.5 + self.down

    def state(self, seq_id: int) -> SequenceAcceptance:
        """The sequence's state (created on first use)."""
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = SequenceAcceptance(self.max_k, float(self.max_k))
        return state

    def draft_len(self, seq_id: int, step: int) -> int:
        """The draft length `seq_id` has earned at `step` (starting a probe when it is due)."""
        state = self.state(seq_id)
        if state.k == 0 and step >= state.probe_at:
            state.k, state.ema, state.probing = 1, self.off_threshold, True
        return state.k

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int, step: int) -> None:
        """Feed one verified step of `seq_id`: `num_accepted` of its `num_draft_tokens`."""
        if num_draft_tokens < 1:
            return
        state = self.state(seq_id)
        state.ema += self.alpha * (num_accepted - state.ema)
        if state.probing and num_accepted:
            state.backoff = 0
        state.probing = False
        if not self._step_down(state):
            self._step_up(state)
        if state.k == 0:
            state.backoff = min(2 * state.backoff, self.max_backoff) or self.first_backoff
            state.probe_at = step + state.backoff

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self._states.pop(seq_id, None)

    def _step_down(self, state: SequenceAcceptance) -> bool:
        """Move k down while the EMA is at or below the next rung's threshold."""
        start = state.k
        while state.k > 1 and state.ema <= state.k - 1.5 + self.down:
            state.k -= 1
        if state.k == 1 and state.ema <= self.off_threshold:
            state.k = 0
        return state.k < start

    def _step_up(self, state: SequenceAcceptance) -> None:
        """Move k up while the EMA is above the current rung's threshold."""
        while 0 < state.k < self.max_k and state.ema > state.k - 0.5 + self.up:
            state.k += 1
