"""What batching alone can buy on a workload: decode-step counts of static vs Orca.

If a decode step cost the same whatever the batch size (a GPU far from its compute limit),
output throughput would be proportional to 1 / decode steps. Counting steps for the
workload's exact output budgets, with requests taken in arrival order and `seats` at a time,
gives the ceiling of orca / static throughput: static runs each batch of `seats` requests
until its longest member ends; Orca refills a freed seat at the next iteration. Real steps
cost more with more sequences, which lowers the measured ratio below this ceiling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBound:
    static_steps: int
    orca_steps: int

    @property
    def ratio(self) -> float:
        """The orca / static throughput ceiling under a flat step cost."""
        return self.static_steps / self.orca_steps


def step_bound(output_lens: list[int], seats: int) -> StepBound:
    """Decode steps to produce `output_lens` tokens (arrival order) with `seats` seats."""
    if seats < 1 or any(n < 1 for n in output_lens):
        raise ValueError("seats and every output length must be at least 1")
    static = sum(max(output_lens[i : i + seats]) for i in range(0, len(output_lens), seats))
    waiting, orca = deque(output_lens), 0
    running: list[int] = []
    while waiting or running:
        while waiting and len(running) < seats:
            running.append(waiting.popleft())
        running = [left - 1 for left in running if left > 1]
        orca += 1
    return StepBound(static_steps=static, orca_steps=orca)
