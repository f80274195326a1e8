"""Settings: one model in five groups (model, cache, scheduler, engine, server).

Every knob is one field here, with its help text. Everything else is derived from these
fields: the CLI flags (gateway/settings/flags.py, grouped as below, named like `vllm serve`'s),
the `CAROUSEL_<NAME>` environment variables, the YAML keys, the per-arm overrides
(gateway/settings/arms.py: the cache, scheduler and engine groups, and `backend`), and what
reaches the engine (gateway/arms/engine_factory.py reads `SchedulerConfig`, `ServingOptions` and
`TorchBackend` arguments by field name). A policy's own knobs (static's `batch_wait_ms`)
are declared by the policy (schedulers/base.py, `Options`) and join the scheduler group.

Precedence: CLI flags > environment > YAML file > defaults. `Settings.load(config_file,
**overrides)` builds them; `overrides` are the flags the user actually gave. The YAML file is
`config_file`, else `$CAROUSEL_CONFIG`; its keys are the field names (`max_num_seqs: 8`; a
`-` reads as `_`). An unknown key, a bad value or an unknown scheduler is refused with the
list of what is valid, before anything starts.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.settings.arms import ArmSettings, check_arms
from gateway.settings.groups import (
    DEFAULT_MODEL,
    CacheSettings,
    EngineSettings,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
    setting_names,
    unhonoured_message,
    unknown_keys_message,
)
from gateway.settings.policy_options import policy_option_names, split_policy_options
from gateway.settings.principals import (
    Principal,
    PrincipalSettings,
    key_principals,
    read_key_file,
)
from gateway.settings.rollout import RolloutSettings
from gateway.settings.rollout_topology import RolloutTopology

DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
ENV_PREFIX = "CAROUSEL_"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: the settings that default to `redis_url` (`with_redis_url`)
SHARED_STORES = ("response_store", "rollout_store")
_config_file: ContextVar[str | None] = ContextVar("carousel_config_file", default=None)


class Settings(
    ServerSettings, EngineSettings, SchedulerSettings, CacheSettings, ModelSettings, BaseSettings
):
    """Everything `carousel serve` can be told (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    #: the deployment's arms (gateway/settings/arms.py); None: one local arm from the flags
    arms: list[ArmSettings] | None = None
    #: API keys by principal, with their limits (gateway/settings/principals.py)
    principals: list[PrincipalSettings] | None = None
    #: a progressive rollout between two of the arms (gateway/settings/rollout.py)
    rollout: RolloutSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        """Read `-` as `_`, gather policy options, refuse unknown keys naming the valid."""
        if not isinstance(data, dict):
            return data
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        data = split_policy_options(data)
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ValueError(unknown_keys_message(unknown, setting_names()))
        return with_redis_url(data)

    @field_validator("api_keys", "admin_api_keys", mode="before")
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

    @field_validator("response_store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if value != "memory" and not is_redis_url(value):
            raise ValueError("response_store must be memory or a redis://host:port/db URL")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and not is_redis_url(value):
            raise ValueError("redis_url must be a redis://host:port/db (or rediss://, unix://) URL")
        return value

    @model_validator(mode="after")
    def _keys_resolve(self) -> Settings:
        """Read `api_key_file` now, so a bad file or a repeated key stops the start-up; and
        `metrics_require_key` needs a key from one of the sources."""
        keys = self.key_principals()
        if self.metrics_require_key and not keys:
            raise ValueError("metrics_require_key needs API keys: no key could open /metrics")
        return self

    def key_principals(self) -> list[tuple[str, Principal]]:
        """Every configured (API key, principal): `api_keys`, `principals`, `api_key_file`."""
        specs = list(self.principals or [])
        if self.api_key_file is not None:
            specs += read_key_file(self.api_key_file)
        return key_principals(self.api_keys, specs)

    @model_validator(mode="after")
    def _honoured(self) -> Settings:
        """Refuse at start-up a setting an arm's backend would ignore, naming it."""
        local = [spec for spec in self.arms or [] if spec.upstream is None]
        arms = [self.model_copy(update=spec.engine_overrides()) for spec in local]
        for settings in arms or [self]:
            message = unhonoured_message(settings)
            if message:
                raise ValueError(message)
        return self

    @model_validator(mode="after")
    def _rollout_arms(self) -> Settings:
        """The rollout's arms exist, take traffic, the compared two do not share one device,
        and at every deciding step their engines carry equal loads (rollout_topology.py)."""
        if self.rollout is None:
            return self
        specs = {a.name: a for a in self.arms or [] if not a.shadow}
        rollout = self.rollout
        names = [rollout.baseline, rollout.candidate] + (
            [rollout.control] if rollout.control else []
        )
        missing = [n for n in names if n not in specs]
        if missing:
            known = ", ".join(specs) or "none (no `arms:`)"
            raise ValueError(f"rollout arm(s) {missing} are not arms of this deployment: {known}")
        compared = (rollout.reference, rollout.candidate)
        local = [specs[n] for n in compared if specs[n].upstream is None]
        devices = {getattr(a, "device", None) or self.device for a in local}
        if len(local) == 2 and len(devices) == 1:
            device = devices.pop() or "the default device"
            raise ValueError(
                f"the rollout's arms `{compared[0]}` and `{compared[1]}` are local arms sharing "
                f"one device ({device}): their latencies confound each other. Give each arm its "
                "own engine: make one an upstream arm (docs/rollout.md)."
            )
        problems = self.rollout_topology().problems(rollout.steps)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def rollout_topology(self) -> RolloutTopology:
        """The rollout's arms and their engines (the rollout must be declared)."""
        assert self.rollout is not None
        return RolloutTopology.of(self.rollout, {a.name: a.engines for a in self.arms or []})

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
        return (
            init_settings,
            env_settings,
            _PolicyOptionsEnv(settings_cls),
            _yaml_source(settings_cls),
        )


class _PolicyOptionsEnv(PydanticBaseSettingsSource):
    """`CAROUSEL_<OPTION>` for the policies' own knobs (they are not fields of Settings)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {
            name: os.environ[key]
            for name in policy_option_names()
            if (key := f"{ENV_PREFIX}{name.upper()}") in os.environ
        }
        return {"scheduler_options": found} if found else {}


def _yaml_source(settings_cls: type[BaseSettings]) -> PydanticBaseSettingsSource:
    path = _config_file.get()
    data: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of setting: value")
        data = split_policy_options({str(k).replace("-", "_"): v for k, v in loaded.items()})
    return InitSettingsSource(settings_cls, init_kwargs=data)


def is_redis_url(value: str) -> bool:
    return value.startswith(REDIS_SCHEMES)


def with_redis_url(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (the merged flags, env and YAML) with `redis_url` as each shared store's
    location where that store's own setting is not given.

    NOTE: the specific setting wins wherever it is given (a flag, `CAROUSEL_*` or YAML), so
    `response_store` and `rollout_store` keep working alone as before, and a deployment may
    keep the rollout in a file while its responses go to the shared Redis. The two stores'
    keys never collide in one database (`carousel:<principal>:<kind>:...` against
    `carousel:rollout:<model>:...`, with disjoint last parts).
    """
    url = data.get("redis_url")
    if not isinstance(url, str) or not is_redis_url(url):
        return data  # none, or refused by its own validator
    return {**dict.fromkeys(SHARED_STORES, url), **data}


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
