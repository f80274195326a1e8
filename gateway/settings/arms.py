"""The arms of a deployment, as written in the YAML settings file (`arms:`).

```yaml
served_model_name: smollm2-135m-instruct
arms:
  - name: orca            # a local engine: a scheduler and its knobs over the shared model
    scheduler: orca
    weight: 50
  - name: static
    scheduler: static
    max_num_seqs: 16
    batch_wait_ms: 20     # a policy's own option
    weight: 50
  - name: vllm            # an upstream OpenAI-compatible server (vLLM, OpenAI, a Carousel)
    weight: 0
    pinnable: true        # clients may still pin it (X-Carousel-Arm); else only allowed keys
    upstream:
      base_urls: ["http://10.0.0.5:8000/v1"]
      model: meta-llama/Llama-3.1-8B-Instruct
  - name: candidate       # a shadow: a copy of every accepted request, answers discarded
    shadow: true
    shadow_fraction: 0.5
    upstream:
      base_urls: ["http://10.0.0.6:8000/v1"]
      model: smollm2-135m-instruct
```

A local arm may set any setting of the cache, scheduler and engine groups, `backend`, and
any policy option (gateway/settings/groups.py); the fields of `ArmSettings` are derived from
those groups, so a new knob is an arm override with no edit here. Unset ones fall back to
the top-level settings. Without `arms:`, the CLI flags describe a one-arm deployment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from gateway.settings.groups import GROUPS, per_arm_names, unknown_keys_message
from gateway.settings.policy_options import (
    check_policy_options,
    check_scheduler,
    policy_option_names,
    split_policy_options,
)

ARM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_ARM_OWN_KEYS = (
    "name",
    "weight",
    "upstream",
    "shadow",
    "shadow_fraction",
    "shadow_queue_size",
    "shadow_concurrency",
    "pinnable",
)

#: a shadow arm's default bounded queue of copies, and how many it sends at once
DEFAULT_QUEUE_SIZE = 256
DEFAULT_CONCURRENCY = 32


class UpstreamSettings(BaseModel):
    """An OpenAI-compatible server (one or more replicas) that answers for an arm."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_urls: list[str] = Field(min_length=1)
    model: str
    api_key: str | None = Field(None, repr=False)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)
    health_interval_s: float = Field(10.0, gt=0)
    max_connections: int = Field(256, ge=1)
    retries: int = Field(2, ge=0)


class ArmBase(BaseModel):
    """One arm: a local engine (its own knobs) or an `upstream` server, and its weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=ARM_NAME_PATTERN)
    weight: float = Field(1.0, ge=0)
    upstream: UpstreamSettings | None = None
    #: a shadow arm gets a copy of the primary arms' accepted requests; its answers are
    #: discarded and its metrics recorded under its own name (gateway/arms/shadow.py)
    shadow: bool = False
    #: the share of requests it gets a copy of
    shadow_fraction: float = Field(1.0, ge=0, le=1)
    #: copies waiting for it beyond this many are dropped (and counted)
    shadow_queue_size: int = Field(DEFAULT_QUEUE_SIZE, ge=1)
    #: copies it serves at once
    shadow_concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1)
    #: any client may pin it with `X-Carousel-Arm` even at zero weight (never a shadow)
    pinnable: bool = False
    #: the policies' own knobs this arm sets (flat keys such as `batch_wait_ms` land here)
    scheduler_options: dict[str, Any] = Field(default_factory=dict)

    if TYPE_CHECKING:  # the knob fields are added from the settings groups (below)

        def __getattr__(self, name: str) -> Any: ...

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = split_policy_options({str(k).replace("-", "_"): v for k, v in data.items()})
        valid = [*_ARM_OWN_KEYS, *per_arm_names()]
        unknown = sorted(set(data) - set(valid) - {"scheduler_options"})
        if unknown:
            raise ValueError(unknown_keys_message(unknown, valid).replace("setting", "arm key"))
        return data

    @field_validator("scheduler", check_fields=False)
    @classmethod
    def _known_scheduler(cls, value: str | None) -> str | None:
        return None if value is None else check_scheduler(value)

    @field_validator("scheduler_options")
    @classmethod
    def _valid_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_policy_options(value)

    @model_validator(mode="after")
    def _upstream_has_no_engine_knobs(self) -> ArmBase:
        if self.upstream is None:
            return self
        local = list(self.engine_overrides())
        if local:
            raise ValueError(
                f"arm {self.name!r} is an upstream arm; engine settings {local} belong to "
                "local arms"
            )
        return self

    def engine_overrides(self) -> dict[str, Any]:
        """The engine knobs this arm sets, by name (policy options under scheduler_options)."""
        names = [n for n in per_arm_names() if n not in set(policy_option_names())]
        found = {k: v for k in names if (v := getattr(self, k, None)) is not None}
        if self.scheduler_options:
            found["scheduler_options"] = dict(self.scheduler_options)
        return found

    @property
    def is_upstream(self) -> bool:
        return self.upstream is not None

    @property
    def engines(self) -> int:
        """How many engines serve this arm: one per upstream URL, one for a local arm."""
        return len(self.upstream.base_urls) if self.upstream is not None else 1


def _optional_knobs() -> dict[str, Any]:
    """Each per-arm setting as an optional field (None: the top-level value) with its checks."""
    infos = {name: info for group in GROUPS.values() for name, info in group.model_fields.items()}
    fields: dict[str, Any] = {}
    for name in per_arm_names():
        info = infos.get(name)
        if info is None:  # a policy option: validated under scheduler_options
            continue
        annotation: Any = info.annotation
        if info.metadata:
            annotation = Annotated[annotation, *info.metadata]
        fields[name] = (annotation | None, Field(None, description=info.description))
    return fields


if TYPE_CHECKING:
    ArmSettings = ArmBase
else:
    ArmSettings = create_model("ArmSettings", __base__=ArmBase, **_optional_knobs())


def check_arms(arms: list[ArmBase]) -> list[ArmBase]:
    """Names unique, at least one arm, and some positive weight."""
    if not arms:
        raise ValueError("`arms` needs at least one arm")
    names = [a.name for a in arms]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"arm names must be unique; repeated: {duplicates}")
    if not any(a.weight > 0 and not a.shadow for a in arms):
        raise ValueError("at least one arm that is not a shadow needs a positive weight")
    return arms
