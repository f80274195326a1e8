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
A new backend is one module with an `AttentionBackend` subclass plus one line in `_BACKENDS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.torch import kernels
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
    "cpu_paged": _Entry("backends.torch.attention.cpu_paged:CpuPagedBackend", ("cpu",)),
    "triton_paged": _Entry(
        "backends.torch.attention.triton_paged:TritonPagedBackend", ("cuda", "cpu")
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
    if "cpu_paged" in names and kernels.native() is None:
        names.remove("cpu_paged")
    if "triton_paged" in names and kernels.triton_why_off(device.type) is not None:
        names.remove("triton_paged")
    return names


def resolve_name(
    name: str, device: torch.device, dtype: torch.dtype | None = None, *, native: bool = True
) -> str:
    """`name`, or for `auto` the best backend available on `device` for a `dtype` cache.

    `native=False`: `auto` leaves Carousel's own CPU kernels out (a name asked for is kept).
    ValueError if `name` is unknown or does not run on `device`.
    """
    if name == AUTO:
        if (
            native
            and device.type == "cpu"
            and kernels.computes(dtype)
            and "cpu_paged" in available_backends(device)
        ):
            return "cpu_paged"
        if (
            device.type == "cuda"
            and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and kernels.triton_why_off("cuda") is None
        ):
            return "triton_paged"
        return "sdpa"
    entry = _BACKENDS.get(name)
    if entry is None:
        known = ", ".join([AUTO, *_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {known}")
    if device.type not in entry.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {', '.join(entry.devices)}, not {device.type}"
        )
    if name == "cpu_paged" and kernels.native() is None:
        raise ValueError(
            f"attention backend 'cpu_paged' needs Carousel's CPU kernels: {kernels.why_off()}"
        )
    why_no_triton = kernels.triton_why_off(device.type)
    if name == "triton_paged" and why_no_triton is not None:
        raise ValueError(f"attention backend 'triton_paged' cannot run here: {why_no_triton}")
    return name


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

    `batch_invariant`: only `cpu_paged`, attending token by token (its `per_token`); ValueError
    where that is not what `name` resolves to.
    """
    dtype = kv_cache.k[0].dtype if kv_cache.k else None
    resolved = resolve_name(name, device, dtype, native=native)
    widest = max((spec.head_dim for spec in layers), default=0)
    if resolved == "cpu_paged" and widest > kernels.max_head_dim():
        if name != AUTO:
            raise ValueError(
                f"attention backend 'cpu_paged' supports head sizes up to "
                f"{kernels.max_head_dim()}, not {widest}"
            )
        resolved = "sdpa"
    module_name, _, class_name = _BACKENDS[resolved].target.partition(":")
    cls: type[AttentionBackend[Any]] = getattr(importlib.import_module(module_name), class_name)
    if not batch_invariant:
        return cls(kv_cache, layers)
    if resolved != "cpu_paged":
        raise ValueError(
            f"batch_invariant needs the cpu_paged attention backend (Carousel's CPU kernels), "
            f"not {resolved}: its decodes and prefills take different kernels"
        )
    return cls(kv_cache, layers, per_token=True)  # type: ignore[call-arg]
