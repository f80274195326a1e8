"""CLI flags derived from the settings groups: one flag per field, grouped in `--help`.

A field `max_num_seqs` is `--max-num-seqs` (a `flag` in its `json_schema_extra` renames it),
typed from its annotation, with its description as help; booleans get `--x / --no-x`,
`Literal`s get choices, lists are repeatable. Policy options (gateway/settings/policy_options.py)
form one more group. Defaults are argparse.SUPPRESS, so only flags the user typed reach
`Settings.load` and cannot shadow env or YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from pydantic_core import PydanticUndefined

from gateway.settings.groups import GROUPS, group_fields
from gateway.settings.policy_options import policy_options
from schedulers.registry import scheduler_class

_TITLES = {
    "model": "model: which model and how it runs",
    "cache": "cache: the paged KV cache (per arm)",
    "scheduler": "scheduler: the batching policy and its budgets (per arm)",
    "engine": "engine: request limits of each local engine (per arm)",
    "server": "server: HTTP, logs and lifecycle",
}


def _concrete(annotation: Any) -> Any:
    """`X` of `X | None` (and of `Annotated[X, ...]`)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _concrete(args[0])
    return annotation


def _flag_kwargs(annotation: Any, help_text: str) -> dict[str, Any]:
    kind = _concrete(annotation)
    kwargs: dict[str, Any] = {"help": help_text}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
    elif typing.get_origin(kind) is list:
        kwargs.update(action="extend", nargs="+", type=typing.get_args(kind)[0])
    elif kind in (int, float, str):
        kwargs["type"] = kind
    return kwargs


def _help(description: str, default: Any) -> str:
    """The description, with the default appended when it says nothing of one."""
    if "default" in description or default is None or isinstance(default, list | dict):
        return description
    if default is PydanticUndefined:
        return description
    shown = ("yes" if default else "no") if isinstance(default, bool) else default
    return f"{description} (default: {shown})"


def add_setting_flags(parser: argparse.ArgumentParser, groups: tuple[str, ...]) -> None:
    """One flag per setting of `groups`, each group its own section of --help."""
    for group in groups:
        section = parser.add_argument_group(_TITLES[group])
        for name, info in group_fields(group):
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            flag = str(extra.get("flag") or "--" + name.replace("_", "-"))
            kwargs = _flag_kwargs(info.annotation, _help(info.description or "", info.default))
            if "metavar" in extra:
                kwargs["metavar"] = extra["metavar"]
            section.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kwargs)
        if group == "scheduler":
            _add_policy_flags(parser)


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    options = policy_options()
    if not options:
        return
    section = parser.add_argument_group("scheduler policy options (each read by its policy)")
    for name, option in sorted(options.items()):
        field: dataclasses.Field[Any] = option.field
        hints = typing.get_type_hints(_owner_options(option.owners[0]))
        section.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            **_flag_kwargs(hints.get(field.name, str), _help(option.help, field.default)),
        )


def _owner_options(policy: str) -> type[Any]:
    return scheduler_class(policy).Options


def settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The settings among parsed `args` (flags the user typed only)."""
    names = {name for group in GROUPS for name, _ in group_fields(group)} | set(policy_options())
    return {k: v for k, v in vars(args).items() if k in names}
