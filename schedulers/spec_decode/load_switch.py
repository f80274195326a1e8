"""Drafting on or off for a whole step, from the load, without flipping step to step.

vLLM's `num_speculative_tokens_per_batch_size` picks k from the count of every scheduled
request, prefills included, with no memory of the last step: a prefill joining four decodes
crosses its threshold, and k flips 2 <-> 0 from one step to the next (vllm #49548). Here the
signal is the number of decoding sequences (a prefill joining changes nothing) and the
switch is a Schmitt trigger: off above `max_concurrency`, on again only at
`max_concurrency - concurrency_hysteresis` or fewer, and never twice within
`min_switch_steps` steps, so any signal flips it at most once per `min_switch_steps` steps.
"""

from __future__ import annotations

from schedulers.spec_decode.config import SpeculativeConfig


class LoadSwitch:
    """Whether a step's sequences may draft, from how many sequences decode in it.

    `max_concurrency` is where verifying the configured k drafts stops paying (the step
    turns compute bound): the adaptive policy's default, 32, was measured
    (config.py's ADAPTIVE_MAX_CONCURRENCY and MEASURED_BASIS; scripts/spec_thresholds.py
    measures it on another machine).
    """

    def __init__(
        self, max_concurrency: int | None, hysteresis: int = 2, min_switch_steps: int = 8
    ) -> None:
        self.max_concurrency = max_concurrency
        self.resume_at = None if max_concurrency is None else max_concurrency - hysteresis
        self.min_switch_steps = min_switch_steps
        self.on = True
        #: how many times the switch has flipped (either way)
        self.num_switches = 0
        self._last_switch: int | None = None

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> LoadSwitch:
        return cls(config.max_concurrency, config.concurrency_hysteresis, config.min_switch_steps)

    def update(self, num_decode_rows: int, step: int) -> bool:
        """Whether sequences draft at `step`, which has `num_decode_rows` decoding sequences
        (steps numbered increasingly)."""
        if self.max_concurrency is None or self.resume_at is None:
            return True
        if self._last_switch is not None and step - self._last_switch < self.min_switch_steps:
            return self.on
        flip = (
            num_decode_rows > self.max_concurrency if self.on else num_decode_rows <= self.resume_at
        )
        if flip:
            self.on = not self.on
            self.num_switches += 1
            self._last_switch = step
        return self.on
