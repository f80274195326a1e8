"""The batching policies' own knobs, seen from the settings: names, validation, flags.

Each policy declares its options as a frozen dataclass (`Scheduler.Options`); here they
become settings: a flat key (`batch_wait_ms`) in flags, env, YAML and per-arm overrides,
gathered under `scheduler_options` and validated against the dataclass of every policy that
declares it (an option of another policy than an arm's is validated, then ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import TypeAdapter, ValidationError

from schedulers.registry import UnknownSchedulerError, builtin_and_installed, scheduler_class


@dataclasses.dataclass(frozen=True)
class PolicyOption:
    """One option name, the policies that declare it and its dataclass field."""

    name: str
    owners: tuple[str, ...]
    field: dataclasses.Field[Any]

    @property
    def help(self) -> str:
        text = str(self.field.metadata.get("help", ""))
        return text or f"{'/'.join(self.owners)} option"


def policy_options() -> dict[str, PolicyOption]:
    """Every option of every registered policy, by name."""
    found: dict[str, PolicyOption] = {}
    for policy, cls in sorted(builtin_and_installed().items()):
        for field in dataclasses.fields(cls.Options):
            known = found.get(field.name)
            owners = (*known.owners, policy) if known else (policy,)
            found[field.name] = PolicyOption(field.name, owners, known.field if known else field)
    return found


def policy_option_names() -> list[str]:
    return sorted(policy_options())


def split_policy_options(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its policy-option keys moved under `scheduler_options`."""
    names = set(policy_options())
    moved = {k: v for k, v in data.items() if k in names}
    if not moved:
        return data
    rest = {k: v for k, v in data.items() if k not in names}
    return {**rest, "scheduler_options": {**dict(rest.get("scheduler_options") or {}), **moved}}


def check_scheduler(spec: str) -> str:
    """`spec` if it names a policy; else ValueError listing the available ones."""
    try:
        scheduler_class(spec)
    except UnknownSchedulerError as exc:
        raise ValueError(str(exc)) from None
    return spec


def check_policy_options(values: dict[str, Any]) -> dict[str, Any]:
    """The options, each validated (and coerced) by the dataclass of every policy owning it."""
    known = policy_options()
    policies = builtin_and_installed()
    checked: dict[str, Any] = {}
    for name, value in values.items():
        option = known.get(name)
        if option is None:
            raise ValueError(
                f"unknown scheduler option {name!r}; options are: {', '.join(sorted(known))}"
            )
        for owner in option.owners:
            adapter = TypeAdapter(policies[owner].Options)
            try:
                options = adapter.validate_python({name: value})
            except ValidationError as exc:
                message = exc.errors()[0]["msg"].removeprefix("Value error, ")
                raise ValueError(f"{name} ({owner}): {message}") from None
            checked[name] = getattr(options, name)
    return checked
