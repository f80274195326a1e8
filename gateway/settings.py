"""Gateway settings: CLI flags > `CAROUSEL_*` environment variables > YAML file > defaults.

`Settings.load(config_file, **overrides)` builds them; `overrides` are the flags the user
actually gave (the CLI never passes argparse defaults, so they cannot shadow env or YAML).
The YAML file is `config_file`, else `$CAROUSEL_CONFIG`; its keys are the field names below
(`max_num_seqs: 8`), and `-` in a key is read as `_`.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.arm_settings import ArmSettings, check_arms

DEFAULT_MODEL = "default"
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
_config_file: ContextVar[str | None] = ContextVar("carousel_config_file", default=None)


class Settings(BaseSettings):
    """Everything `carousel serve` can be told; see docs/quickstart.md for the flags."""

    model_config = SettingsConfigDict(env_prefix="CAROUSEL_", extra="forbid", frozen=True)

    # -- the model and how it runs -------------------------------------------------------
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    backend: Literal["torch", "sim"] = "torch"
    scheduler: str = "orca"
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    batch_wait_ms: float = Field(default=0.0, ge=0)
    enable_chunked_prefill: bool = False
    kv_cache_gb: float | None = Field(default=None, gt=0)
    device: str | None = None
    dtype: str | None = None
    block_size: int = Field(default=16, ge=1)
    #: CPU bf16/fp16/fp32: keep a oneDNN-prepacked copy of the weights for small matmuls
    prepack_weights: bool = True
    # the simulator backend (weight-free): seconds slept per simulated second, KV size
    sim_time_scale: float = Field(default=0.0, ge=0)
    sim_num_blocks: int = Field(default=4096, ge=1)
    sim_max_model_len: int = Field(default=4096, ge=1)

    #: the deployment's arms (gateway/arm_settings.py); None: one local arm from the flags
    arms: list[ArmSettings] | None = None

    # -- HTTP -----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    #: refuse new requests with 429 while this many requests wait in an engine (None: never)
    max_waiting_requests: int | None = Field(default=1024, ge=0)
    #: completion budget when a request gives no max_tokens: min(this, context - prompt)
    default_max_tokens: int = Field(default=4096, ge=1)
    retry_after_s: int = Field(default=1, ge=0)
    #: SSE keep-alive comment interval in seconds (0 disables)
    sse_ping_s: float = Field(default=0.0, ge=0)
    #: how often a non-streaming request checks whether its client went away
    disconnect_poll_s: float = Field(default=0.1, gt=0)

    # -- logs -----------------------------------------------------------------------------
    log_level: str = "info"
    log_prompts: bool = False
    log_json: bool = True

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """Accept a JSON list or a comma-separated string (`CAROUSEL_API_KEYS=a,b`)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [k.strip() for k in text.split(",") if k.strip()]
        return value

    @field_validator("arms")
    @classmethod
    def _check_arms(cls, value: list[ArmSettings] | None) -> list[ArmSettings] | None:
        return None if value is None else check_arms(value)

    @property
    def model_name(self) -> str:
        """The name clients put in `model`."""
        return self.served_model_name or default_served_name(self.model)

    @classmethod
    def load(cls, config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
        """Settings from `overrides` > env > the YAML file > defaults."""
        path = config_file or os.environ.get("CAROUSEL_CONFIG")
        token = _config_file.set(str(path) if path else None)
        try:
            return cls(**overrides)
        finally:
            _config_file.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _yaml_source(settings_cls)

    # -- reliability (docs/reliability.md) --------------------------------------------------
    #: 400 context_length_exceeded above this many prompt tokens (None: the context window)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    #: 429 queue_timeout for a request the engine has not scheduled within this (None: never)
    max_queue_wait_s: float | None = Field(default=None, gt=0)
    #: on SIGTERM/SIGINT: 503 new requests, let those in flight run this long, then end them
    drain_timeout_s: float = Field(default=10.0, ge=0)
    #: serve /metrics without an API key even when api_keys are set
    metrics_open: bool = True


def _yaml_source(settings_cls: type[BaseSettings]) -> PydanticBaseSettingsSource:
    path = _config_file.get()
    data: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of setting: value")
        data = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    return InitSettingsSource(settings_cls, init_kwargs=data)


def default_served_name(model: str) -> str:
    """`default` -> smollm2-135m-instruct; a dir or .gguf file -> its name; a hub id as is."""
    if model == DEFAULT_MODEL:
        return DEFAULT_SERVED_MODEL_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model
