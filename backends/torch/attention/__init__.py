"""Attention backends by name, imported lazily (a CUDA-only kernel is never imported on CPU).

| name | device | what |
|---|---|---|
| `sdpa` | any | reference: SDPA per prefill, one masked SDPA over gathered K/V for decodes |
| `inductor_paged` | cpu | decodes read K/V in place through one Inductor-compiled kernel |
| `cpu_paged` | cpu | decodes read K/V in place through Carousel's own AVX-512 kernel |
| `triton_paged` | cuda | the whole mixed step in one Triton kernel, K/V read in place |

`auto` is `cpu_paged` on a CPU where Carousel's kernels build (AVX-512 with BF16, a C++
compiler; backends/torch/cpu_kernels) and the cache is fp32 or bf16, else `sdpa`; on CUDA it
is `triton_paged` where triton is installed (fp32, bf16 or fp16 cache), else `sdpa`.
`triton_paged` runs on the CPU only in Triton's interpreter (`TRITON_INTERPRET=1`, for
tests), and `auto` never picks it there. On the 2-core CPU `cpu_paged` cut the bare bf16
decode step at B = 64 by a quarter (docs/benchmarks/history/). `inductor_paged` was faster
than `sdpa` only in bf16 at B >= 32 (-11% at B = 64), slower in fp32 at B >= 32, and costs
a 2-4 s compile.
Each backend answers for itself where it runs (`why_unavailable`: device, cache dtype, head
size) and whether `auto` takes it (`preferred_on`); `auto` asks them in `_AUTO_ORDER`. A new
backend is one module with an `AttentionBackend` subclass plus one line in `_BACKENDS` (and
its place in `_AUTO_ORDER` if `auto` should ever take it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from backends.torch.attention.base import AttentionBackend, AttentionSpec
from backends.torch.kv_cache import KVCache

AUTO = "auto"

#: name -> "module:Class", imported on first use
_BACKENDS = {
    "sdpa": "backends.torch.attention.sdpa:SDPABackend",
    "inductor_paged": "backends.torch.attention.inductor_paged:InductorPagedBackend",
    "cpu_paged": "backends.torch.attention.cpu_paged:CpuPagedBackend",
    "triton_paged": "backends.torch.attention.triton_paged:TritonPagedBackend",
}
#: what `auto` asks, best first; the reference, which runs anywhere, last
_AUTO_ORDER = ("cpu_paged", "triton_paged", "sdpa")


def backend_names() -> list[str]:
    """Every registered backend name (whether or not it runs here)."""
    return list(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend[Any]]:
    """The class registered as `name` (its module imported now); ValueError if unknown."""
    target = _BACKENDS.get(name)
    if target is None:
        known = ", ".join([AUTO, *_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {known}")
    module_name, _, class_name = target.partition(":")
    cls: type[AttentionBackend[Any]] = getattr(importlib.import_module(module_name), class_name)
    return cls


def available_backends(device: torch.device) -> list[str]:
    """The registered backends that can run on `device` in this environment."""
    return [n for n in _BACKENDS if backend_class(n).why_unavailable(device) is None]


def resolve_name(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    *,
    native: bool = True,
    head_dim: int = 0,
) -> str:
    """`name`, or for `auto` the best backend available on `device` for a `dtype` cache and
    heads of `head_dim`.

    `native=False`: `auto` leaves Carousel's own CPU kernels out (a name asked for is kept).
    ValueError if `name` is unknown or does not run there.
    """
    if name == AUTO:
        return next(
            n for n in _AUTO_ORDER if _auto_takes(backend_class(n), device, dtype, native, head_dim)
        )
    reason = backend_class(name).why_unavailable(device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} {reason}")
    return name


def _auto_takes(
    cls: type[AttentionBackend[Any]],
    device: torch.device,
    dtype: torch.dtype | None,
    native: bool,
    head_dim: int,
) -> bool:
    """Whether `auto` takes `cls` here: preferred, runnable, and not left out with the CPU
    kernels."""
    if cls.native_decodes and not native:
        return False
    return cls.preferred_on(device, dtype) and cls.why_unavailable(device, dtype, head_dim) is None


def create_backend(
    name: str,
    kv_cache: KVCache,
    layers: Sequence[AttentionSpec],
    device: torch.device,
    *,
    native: bool = True,
    batch_invariant: bool = False,
) -> AttentionBackend[Any]:
    """Build backend `name` (or `auto`'s choice, see `resolve_name`) over `kv_cache`.

    `batch_invariant`: only a backend that attends token by token (cpu_paged's `per_token`);
    ValueError where that is not what `name` resolves to.
    """
    dtype = kv_cache.k[0].dtype if kv_cache.k else None
    widest = max((spec.head_dim for spec in layers), default=0)
    cls = backend_class(resolve_name(name, device, dtype, native=native, head_dim=widest))
    if not batch_invariant:
        return cls(kv_cache, layers)
    if not cls.token_by_token:
        raise ValueError(
            f"batch_invariant needs the cpu_paged attention backend (Carousel's CPU kernels), "
            f"not {cls.name}: its decodes and prefills take different kernels"
        )
    return cls(kv_cache, layers, per_token=True)  # type: ignore[call-arg]
