"""Forwards swapped into the HF model's modules for the duration of a step, then given back.

The generic path's speed-ups (packed linears, fused siblings, native norms and MLPs: fusion.py)
each replace some modules' `forward` with Carousel's. A `StepSwaps` holds them, at most one per
module (a later one replaces an earlier), and `swapped_in` sets them as instance attributes
for the block, deleting them afterwards: the same HF model may run `generate`, or serve a
native arm, between two steps. Hooks still run (`nn.Module.__call__` calls the instance's
`forward`). `same_code` is how a swap checks that a class computes the formula it replaces.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

Forward = Callable[..., Any]


class StepSwaps:
    """Modules' step-time forwards, and what to clear after each step (see the module)."""

    def __init__(self) -> None:
        self._forwards: dict[int, tuple[nn.Module, Forward]] = {}
        self._after_step: list[Callable[[], None]] = []

    def put(self, module: nn.Module, forward: Forward) -> None:
        """`module`'s forward during a step (replacing any put before for it)."""
        self._forwards[id(module)] = (module, forward)

    def holds(self, module: nn.Module) -> bool:
        return id(module) in self._forwards

    def after_step(self, clear: Callable[[], None]) -> None:
        """Call `clear` when each step's block ends (a cache of the step's tensors)."""
        self._after_step.append(clear)

    def __len__(self) -> int:
        return len(self._forwards)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The swapped forwards for the block; the modules' own afterwards."""
        # NOTE: straight into the instance dicts: `nn.Module.__setattr__` / `__delattr__` look
        # through its parameters, buffers and children first, 0.39 ms a step for Gemma 3 270M's
        # 236 swaps against 0.04 ms (a function is none of those, so the result is the same)
        held = [(vars(module), forward) for module, forward in self._forwards.values()]
        for attributes, forward in held:
            attributes["forward"] = forward
        try:
            yield
        finally:
            for attributes, _ in held:
                attributes.pop("forward", None)
            for clear in self._after_step:
                clear()


def same_code(cls: type[Any], name: str, reference: Callable[..., Any]) -> bool:
    """Whether `cls.<name>` runs the very code of `reference` (both unwrapped of decorators):
    same bytecode, constants, names and variables, so the same formula over the same
    attributes. transformers copies a shared layer's code into each model (`# Copied from`,
    modular files), so one reference covers every model that copied it."""
    method = getattr(cls, name, None)
    if method is None:
        return False
    return _code_key(method) == _code_key(reference)


def _code_key(function: Callable[..., Any]) -> tuple[Any, ...] | None:
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_freevars)


def own_forward(module: nn.Module) -> bool:
    """Whether `module` runs its class's forward (none swapped onto the instance already)."""
    return "forward" not in module.__dict__
