"""Batching policies by name: the built-ins (every module of schedulers/policies/), those
of installed packages (the `carousel.schedulers` entry-point group), and any class named
as `package.module:ClassName`.

An out-of-tree policy is a `Scheduler` subclass; its package declares it with

    [project.entry-points."carousel.schedulers"]
    fair = "my_policies.fair:FairScheduler"

and it is then served with `--scheduler fair` (or `--scheduler my_policies.fair:FairScheduler`
without installing an entry point). docs/schedulers.md walks through one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import schedulers.policies
from schedulers.base import Scheduler, SchedulerConfig
from schedulers.block_manager import BlockManager

ENTRY_POINT_GROUP = "carousel.schedulers"
_REGISTRY: dict[str, type[Scheduler]] = {}
_loaded = False


class UnknownSchedulerError(ValueError):
    """A scheduler name or `module:Class` spec that names no policy."""


def register_scheduler(name: str) -> Callable[[type[Scheduler]], type[Scheduler]]:
    """Class decorator adding a policy to the registry under `name`."""

    def decorate(cls: type[Scheduler]) -> type[Scheduler]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load() -> None:
    """Import the built-ins, then the installed entry points (built-ins win a name clash)."""
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules(schedulers.policies.__path__):
        importlib.import_module(f"{schedulers.policies.__name__}.{module.name}")
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name not in _REGISTRY:
            cls = _check_policy(entry_point.load(), entry_point.value)
            cls.name = cls.name or entry_point.name
            _REGISTRY[entry_point.name] = cls
    _loaded = True


def _check_policy(obj: Any, spec: str) -> type[Scheduler]:
    if not (isinstance(obj, type) and issubclass(obj, Scheduler)):
        raise UnknownSchedulerError(f"{spec!r} is not a Scheduler subclass")
    return obj


def available_schedulers() -> list[str]:
    """Every registered policy name, sorted."""
    _load()
    return sorted(_REGISTRY)


def builtin_and_installed() -> dict[str, type[Scheduler]]:
    """Name -> class of every registered policy."""
    _load()
    return dict(_REGISTRY)


def scheduler_class(spec: str) -> type[Scheduler]:
    """The policy `spec` names: a registered name or `package.module:ClassName`."""
    _load()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
            obj = getattr(module, attr)
        except (ImportError, AttributeError) as exc:
            raise UnknownSchedulerError(f"cannot load scheduler {spec!r}: {exc}") from None
        cls = _check_policy(obj, spec)
        cls.name = cls.name or attr
        return cls
    raise UnknownSchedulerError(
        f"unknown scheduler {spec!r}; available: {', '.join(available_schedulers())} "
        "(or package.module:ClassName)"
    )


def make_options(cls: type[Scheduler], values: Mapping[str, Any]) -> Any:
    """`cls.Options` from the values of its fields among `values` (others are ignored)."""
    names = {f.name for f in dataclasses.fields(cls.Options)}
    return cls.Options(**{k: v for k, v in values.items() if k in names})


def create_scheduler(
    spec: str,
    config: SchedulerConfig,
    block_manager: BlockManager,
    options: Mapping[str, Any] | None = None,
) -> Scheduler:
    """Build the policy `spec` names, with its own options taken from `options`."""
    cls = scheduler_class(spec)
    return cls(config, block_manager, make_options(cls, options or {}))
