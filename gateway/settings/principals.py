"""API keys grouped by principal, with optional per-principal limits.

```yaml
principals:                 # in the --config file, or alone in --api-key-file
  - name: team-a            # what logs, the store and limits call it (never the key)
    keys: ["sk-a-1", "sk-a-2"]
    allowed_arms: [vllm]    # zero-weight arms this principal may pin (X-Carousel-Arm)
    max_in_flight: 8        # 429 beyond this many of its requests at once
    max_stored_bytes: 1048576   # its share of the response store
    min_priority: 5         # its most urgent `priority` (lower runs first); lower is a 400
    min_deadline_ms: 2000   # its shortest X-Carousel-Deadline-Ms; a shorter one is a 400
  - name: ops
    keys: ["sk-ops-1"]
    admin: true             # may call /admin/... (`carousel rollout`); others then get 403
```

A key given by `--api-key` is a principal of its own, named `key-<8 hex of its sha256>` (so
the name says nothing of the secret). Keys need not be on the command line: the file named by
`--api-key-file` (`CAROUSEL_API_KEY_FILE`) holds the same list, or a mapping with
`principals:`. With no key at all every request is the principal `anonymous` (a name no key
file may take).

`min_priority` and `min_deadline_ms` bound what the principal's requests may ask of the
scheduler (gateway/api/scheduling.py): asking beyond them is a 400, and a request that asks
nothing is never given more (its priority is at least `min_priority`, its first-token deadline
at least `min_deadline_ms`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, field_validator

PRINCIPAL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"
ANONYMOUS_NAME = "anonymous"
#: the range of a request's `priority` (gateway/api/protocol.py)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class PrincipalSettings(BaseModel):
    """One principal as configured: its keys and its optional limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=PRINCIPAL_NAME_PATTERN)
    keys: list[SecretStr] = Field(min_length=1, repr=False)
    allowed_arms: list[str] | None = None
    max_in_flight: int | None = Field(None, ge=1)
    max_stored_bytes: int | None = Field(None, ge=1)
    admin: bool = False
    min_priority: int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    min_deadline_ms: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _not_anonymous(cls, name: str) -> str:
        if name == ANONYMOUS_NAME:
            raise ValueError(f"{ANONYMOUS_NAME!r} is the name of requests without a key")
        return name

    def principal(self) -> Principal:
        arms = None if self.allowed_arms is None else frozenset(self.allowed_arms)
        return Principal(
            self.name,
            arms,
            self.max_in_flight,
            self.max_stored_bytes,
            admin=self.admin,
            min_priority=self.min_priority,
            min_deadline_ms=self.min_deadline_ms,
        )


@dataclass(frozen=True)
class Principal:
    """Who sent a request, as the gateway knows them: a name and limits, never a key."""

    name: str
    #: arms beyond the weighted ones that this principal may pin (None: only those)
    allowed_arms: frozenset[str] | None = None
    #: its requests at once (None: unbounded)
    max_in_flight: int | None = None
    #: bytes of stored responses it may keep (None: the store's default share)
    max_stored_bytes: int | None = None
    #: may call the `/admin/...` routes (with any admin configured, only admins may)
    admin: bool = False
    #: the most urgent `priority` its requests may have (lower runs first; None: any)
    min_priority: int | None = None
    #: the shortest first-token deadline its requests may have, in ms (None: any)
    min_deadline_ms: float | None = None


ANONYMOUS = Principal(ANONYMOUS_NAME)
_PRINCIPALS = TypeAdapter(list[PrincipalSettings])


def key_principal_name(key: str) -> str:
    """The name of a bare `--api-key` key's principal: no part of the key itself."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


def read_key_file(path: str | Path) -> list[PrincipalSettings]:
    """The principals of an `--api-key-file` (a YAML list, or a mapping with `principals`).

    NOTE: errors name the file and what is wrong, never a key's value."""
    try:
        loaded: Any = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"api_key_file {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError:
        raise ValueError(f"api_key_file {path}: not valid YAML") from None
    if isinstance(loaded, dict) and set(loaded) == {"principals"}:
        loaded = loaded["principals"]
    if not isinstance(loaded, list):
        raise ValueError(f"api_key_file {path}: must hold a list of principals")
    try:
        return _PRINCIPALS.validate_python(loaded)
    except ValueError as exc:
        raise ValueError(f"api_key_file {path}: {_problems(exc)}") from None


def _problems(exc: ValueError) -> str:
    """A validation error's locations and messages, without the input values (secrets)."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return "invalid"
    return "; ".join(
        ".".join(str(p) for p in e["loc"]) + ": " + e["msg"]
        for e in errors(include_input=False, include_url=False)
    )


def key_principals(
    api_keys: list[str], principals: list[PrincipalSettings]
) -> list[tuple[str, Principal]]:
    """Every (key, principal) pair; a repeated principal name or key is refused."""
    pairs = [(key, Principal(key_principal_name(key))) for key in api_keys]
    names = [p.name for p in principals]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"principal names must be unique; repeated: {repeated}")
    for spec in principals:
        pairs += [(key.get_secret_value(), spec.principal()) for key in spec.keys]
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("an API key is given more than once (keys are not shown)")
    return pairs
