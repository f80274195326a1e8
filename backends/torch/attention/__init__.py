"""Attention backends by name, imported lazily (a CUDA-only kernel is never imported on CPU).

| name | device | what |
|---|---|---|
| `sdpa` | any | reference: SDPA per prefill, one masked SDPA over gathered K/V for decodes |
| `inductor_paged` | cpu | decodes read K/V in place through one Inductor-compiled kernel |

`auto` is `sdpa` on every device: on the 2-core CPU `inductor_paged` is faster only in bf16
at B >= 32 (decode step -11% at B = 64, 0-5% elsewhere), slower in fp32 at B >= 32, and it
costs a 2-4 s compile at start-up (docs/benchmarks.md, issue 15, third pass).
A new backend is one module with an `AttentionBackend` subclass plus one line in `_BACKENDS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.torch.attention.base import AttentionBackend, AttentionSpec
from backends.torch.kv_cache import KVCache

AUTO = "auto"


@dataclass(frozen=True)
class _Entry:
    target: str  # "module:Class", imported on first use
    devices: tuple[str, ...]  # device types it runs on


_BACKENDS = {
    "sdpa": _Entry("backends.torch.attention.sdpa:SDPABackend", ("cpu", "cuda", "mps", "xpu")),
    "inductor_paged": _Entry(
        "backends.torch.attention.inductor_paged:InductorPagedBackend", ("cpu",)
    ),
}


def backend_names() -> list[str]:
    """Every registered backend name (whether or not it runs here)."""
    return list(_BACKENDS)


def available_backends(device: torch.device) -> list[str]:
    """The registered backends that can run on `device` in this environment."""
    from backends.torch import inductor

    names = [n for n, e in _BACKENDS.items() if device.type in e.devices]
    if not inductor.compiler_available():
        names = [n for n in names if not n.startswith("inductor")]
    return names


def resolve_name(name: str, device: torch.device) -> str:
    """`name`, or for `auto` the best backend available on `device`; ValueError if unknown."""
    if name == AUTO:
        return "sdpa"
    entry = _BACKENDS.get(name)
    if entry is None:
        known = ", ".join([AUTO, *_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {known}")
    if device.type not in entry.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {', '.join(entry.devices)}, not {device.type}"
        )
    return name


def create_backend(
    name: str, kv_cache: KVCache, layers: Sequence[AttentionSpec], device: torch.device
) -> AttentionBackend[Any]:
    """Build backend `name` (or `auto`'s choice) for these layers over `kv_cache`."""
    module_name, _, class_name = _BACKENDS[resolve_name(name, device)].target.partition(":")
    cls: type[AttentionBackend[Any]] = getattr(importlib.import_module(module_name), class_name)
    return cls(kv_cache, layers)
