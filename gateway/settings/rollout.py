"""A deployment's progressive rollout, as written in the YAML settings (`rollout:`).

```yaml
rollout:
  baseline: orca            # an arm of this deployment (production)
  control: orca-control     # an engine of the baseline's config at the candidate's share
  candidate: sjf            # another arm (local or upstream)
  assignment: user          # or request: what the split randomises, and the tests' unit
  steps: [5, 25, 50, 100]   # candidate's share of traffic, percent
  metric: ttft_p50          # what must improve: ttft_p50|ttft_p99|tpot_p50|e2e_p50|error_rate
  guardrails:               # largest tolerated regression of the candidate
    error_rate: 0.005       # absolute
    ttft_p99: 0.10          # relative
    tpot_p50: 0.10
  min_requests: 100         # per arm per step before any decision
  max_step_s: 3600          # a step that decides nothing by then holds
  on_no_difference: hold    # or promote, when the equivalence test says "no difference"
  alpha: 0.05
```

What each key means for the tests is in gateway/rollout/spec.py and docs/rollout.md; the
metrics `metric` and `guardrails` may name, in gateway/settings/rollout_metrics.py; which arm
topologies compare equal loads (and are therefore accepted) in rollout_topology.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.settings.rollout_metrics import GUARDRAIL_METRICS, TARGET_METRICS, current_name


class RolloutSettings(BaseModel):
    """The `rollout:` block: from `baseline` to `candidate`, step by step, under tests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    baseline: str
    candidate: str
    #: the arm the candidate is compared with, at the candidate's share (Kayenta's baseline)
    control: str | None = None
    #: what the split randomises: a user (sticky, by the `user` field) or each request
    assignment: Literal["user", "request"] = "user"
    #: the requests summarised into a unit's one sample: a user's first this-many of a step
    #: (requests without `user`, or any under `assignment: request`: an arm's first this-many
    #: in each block of the step's requests; gateway/rollout/evidence.py)
    requests_per_unit: int = Field(5, ge=1, le=100)
    steps: list[float] = Field(default=[5, 25, 50, 100], min_length=1)
    #: what must improve: a name of `TARGET_METRICS` (`goodput`, its earlier name for the
    #: error rate, is read as `error_rate`)
    metric: str = Field("ttft_p50", json_schema_extra={"enum": list(TARGET_METRICS)})
    guardrails: dict[str, float] = Field(default_factory=lambda: {"error_rate": 0.005})
    min_requests: int = Field(100, ge=1)
    max_step_s: float = Field(3600.0, gt=0)
    on_no_difference: Literal["hold", "promote"] = "hold"
    alpha: float = Field(0.05, gt=0, lt=1)

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
            raise ValueError("steps must be increasing percentages in (0, 100]")
        if steps[-1] != 100:
            raise ValueError("the last step must be 100 (the candidate takes all traffic)")
        return steps

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        name = current_name(metric)
        if name not in TARGET_METRICS:
            valid = ", ".join(TARGET_METRICS)
            raise ValueError(f"unknown metric {metric!r}; valid: {valid}")
        return name

    @field_validator("guardrails")
    @classmethod
    def _known_guardrails(cls, guardrails: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(guardrails) - set(GUARDRAIL_METRICS))
        if unknown:
            valid = ", ".join(GUARDRAIL_METRICS)
            raise ValueError(f"unknown guardrail(s) {', '.join(unknown)}; valid: {valid}")
        if any(not 0 <= v < 1 for v in guardrails.values()):
            raise ValueError("a guardrail's tolerated regression must lie in [0, 1)")
        return guardrails

    @model_validator(mode="after")
    def _two_arms(self) -> RolloutSettings:
        names = [self.baseline, self.candidate] + ([self.control] if self.control else [])
        if len(set(names)) != len(names):
            raise ValueError("the rollout's baseline, candidate and control must be different arms")
        return self

    @property
    def reference(self) -> str:
        """The arm the tests compare the candidate with: `control`, else `baseline`."""
        return self.control or self.baseline
