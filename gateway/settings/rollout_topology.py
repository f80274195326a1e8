"""Which arms a rollout's tests compare, and at what load: the equal-load rule.

A batching policy's latency is a function of the load its engine carries, so a comparison
decides only between arms whose engines carry the same load, the same way. The split sets
that load: an arm with weight w percent over e engines gives each engine w / e percent of the
traffic. The tests compare the candidate with its *reference*: the `control` arm when there
is one, else the baseline. At every step that decides (every step but the last, 100%):

- the candidate and the reference have as many engines: a pool spreads concurrent requests
  over its engines (least outstanding first) where one engine batches them, so a pool of 9
  and one engine at 90/10 do not carry their equal average load alike (measured: the one
  engine's p50 e2e 8-10% higher, identical sim engines, tests/test_ab_equal_load.py);
- they take equal shares. With `control` (Kayenta's topology: production keeps the baseline's
  fleet, and a control of the baseline's config, as many engines as the candidate's, is
  deployed beside it) the control takes the candidate's share and the baseline the rest;
  refused when a step leaves the baseline less than nothing (above 50%). Without, the
  baseline takes `100 - share`, equal only at 50%.

An arm's engines: one for a local arm, one per URL of an upstream arm's `base_urls` (list every
engine's own URL there, not a load balancer's).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.settings.rollout import RolloutSettings


@dataclass(frozen=True)
class RolloutTopology:
    """The rollout's arms and how many engines serve each."""

    baseline: str
    candidate: str
    control: str | None
    engines: dict[str, int]

    @classmethod
    def of(cls, rollout: RolloutSettings, engines: dict[str, int]) -> RolloutTopology:
        """`rollout`'s arms, each with its engines in `engines` (1 when not given)."""
        names = [n for n in (rollout.baseline, rollout.candidate, rollout.control) if n]
        counts = {name: engines.get(name, 1) for name in names}
        return cls(rollout.baseline, rollout.candidate, rollout.control, counts)

    @property
    def reference(self) -> str:
        return self.control or self.baseline

    @property
    def arms(self) -> tuple[str, ...]:
        """Every arm of the rollout (baseline, candidate, control)."""
        return tuple(self.engines)

    def weights(self, share: float) -> dict[str, float]:
        """Each arm's share of traffic, percent, while the candidate's is `share`."""
        if share >= 100:
            out = {self.baseline: 0.0, self.candidate: 100.0}
            return out | ({self.control: 0.0} if self.control else {})
        if self.control is None:
            return {self.baseline: 100.0 - share, self.candidate: share}
        return {
            self.baseline: max(0.0, 100.0 - 2 * share),
            self.control: share,
            self.candidate: share,
        }

    def problems(self, steps: list[float]) -> list[str]:
        """Why the deciding steps (all but the last) would compare unequal loads; [] if none."""
        n_cand, n_ref = self.engines[self.candidate], self.engines[self.reference]
        if n_cand != n_ref:
            return [
                f"the candidate `{self.candidate}` has {n_cand} engine(s) and its reference "
                f"`{self.reference}` {n_ref}: pools of different sizes carry the same load "
                "differently (one engine batches what a pool spreads). Give them as many "
                "engines each (docs/rollout.md)"
            ]
        deciding = steps[:-1]
        if self.control is not None:
            over = [s for s in deciding if s > 50]
            if not over:
                return []
            return [
                f"at step(s) {_percents(over)} the candidate `{self.candidate}` and the control "
                f"`{self.control}` would need more than all the traffic between them: keep the "
                "deciding steps at most 50% (docs/rollout.md)"
            ]
        unequal = [f"{s:g}% ({(100 - s) / s:.3g}x)" for s in deciding if s != 50]
        if not unequal:
            return []
        return [
            f"the rollout would compare the candidate `{self.candidate}` with the baseline "
            f"`{self.baseline}` at unequal loads: at step(s) {', '.join(unequal)} the baseline "
            "would carry that many times the candidate's traffic. Declare a `control:` arm (the "
            "baseline's config, as many engines as the candidate's, at the candidate's share) "
            "or use steps [50, 100] (docs/rollout.md)"
        ]


def _percents(shares: list[float]) -> str:
    return ", ".join(f"{s:g}%" for s in shares)
