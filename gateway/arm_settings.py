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
    weight: 50
  - name: vllm            # an upstream OpenAI-compatible server (vLLM, OpenAI, a Carousel)
    weight: 0
    upstream:
      base_urls: ["http://10.0.0.5:8000/v1"]
      model: meta-llama/Llama-3.1-8B-Instruct
```

A local arm's unset knobs fall back to the top-level settings. Without `arms:`, the CLI
flags describe a one-arm deployment.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: what a local arm may set for itself; unset ones come from the top-level settings
ENGINE_KNOBS = (
    "scheduler",
    "backend",
    "max_num_seqs",
    "max_num_batched_tokens",
    "batch_wait_ms",
    "enable_chunked_prefill",
    "kv_cache_gb",
)


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


class ArmSettings(BaseModel):
    """One arm: a local engine (scheduler + knobs) or an `upstream` server, and its weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=ARM_NAME_PATTERN)
    weight: float = Field(1.0, ge=0)
    upstream: UpstreamSettings | None = None
    scheduler: str | None = None
    backend: Literal["torch", "sim"] | None = None
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    batch_wait_ms: float | None = Field(None, ge=0)
    enable_chunked_prefill: bool | None = None
    kv_cache_gb: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _upstream_has_no_engine_knobs(self) -> ArmSettings:
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
        """The engine knobs this arm sets, by name."""
        return {k: v for k in ENGINE_KNOBS if (v := getattr(self, k)) is not None}

    @property
    def is_upstream(self) -> bool:
        return self.upstream is not None


def check_arms(arms: list[ArmSettings]) -> list[ArmSettings]:
    """Names unique, at least one arm, and some positive weight."""
    if not arms:
        raise ValueError("`arms` needs at least one arm")
    names = [a.name for a in arms]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"arm names must be unique; repeated: {duplicates}")
    if not any(a.weight > 0 for a in arms):
        raise ValueError("at least one arm needs a positive weight")
    return arms
