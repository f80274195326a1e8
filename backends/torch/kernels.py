"""The one import point of compiled kernels: ops and backends ask here, never a build package
(and torch's own weight-only int4/int8 ops, at the end: torch ships them, nothing is built).

A compiled-kernel package registers itself with one line of `_PROVIDERS` (device type ->
module). Where it is missing (deleted, hidden, not importable) or cannot run here, `native()`
is None and every op keeps its `forward_native` (torch's own kernels). Importing this module
imports no kernel package: the first call that needs one does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

_PROVIDERS = {
    "cpu": "backends.torch.cpu_kernels",
}


def _package(device_type: str = "cpu") -> ModuleType | None:
    """The registered kernel package for `device_type`, or None where there is none."""
    name = _PROVIDERS.get(device_type)
    if name is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def native(device_type: str = "cpu", *, background: bool = False) -> ModuleType | None:
    """The compiled kernels for `device_type` (built on first use), or None where none run.

    `background`: a build this starts runs while the server serves on torch's ops, so it is
    no load phase (`/health` stays ready; runner/kernel_switch.py)."""
    package = _package(device_type)
    if package is None:
        return None
    return package.native(background=background)  # type: ignore[no-any-return]


def is_built(device_type: str = "cpu") -> bool:
    """Whether `native()` answers without compiling (built, or unable to run here at all)."""
    package = _package(device_type)
    return package is None or bool(package.is_built())


def why_off(device_type: str = "cpu") -> str:
    """Why `native()` is None."""
    package = _package(device_type)
    if package is None:
        return f"no compiled kernel package for {device_type} is installed"
    return str(package.why_off())


def computes(dtype: torch.dtype | None, device_type: str = "cpu") -> bool:
    """Whether the compiled kernels for `device_type` run here and compute in `dtype`."""
    package = _package(device_type)
    return package is not None and dtype in package.DTYPES and package.native() is not None


def max_head_dim(device_type: str = "cpu") -> int:
    """The widest attention head the compiled decode attention takes (0: none)."""
    package = _package(device_type)
    return 0 if package is None else int(package.MAX_HEAD_DIM)


def amx_on() -> bool:
    """Whether the CPU kernels' bf16 linears take AMX tiles here."""
    package = _package("cpu")
    return package is not None and bool(package.amx_on())


TRITON_PACKAGE = "backends.torch.triton_kernels"


def _triton_interpreting() -> bool:
    """Whether Triton's interpreter is asked for (its own reading of `TRITON_INTERPRET`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_why_off(device_type: str) -> str | None:
    """Why Carousel's Triton kernels cannot run on `device_type` here (None: they can).

    On CUDA they compile; on the CPU they run only in Triton's interpreter, which is for
    tests (`TRITON_INTERPRET=1` before they are first imported). Checking imports nothing.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if device_type != "cpu":
        return f"not on {device_type}"
    if not _triton_interpreting():
        return "on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)"
    return None


def triton(device_type: str) -> ModuleType:
    """Carousel's Triton kernels (backends/torch/triton_kernels), imported on first use.

    RuntimeError where they cannot run on `device_type` (see `triton_why_off`), or on the
    CPU when they were imported before the interpreter was asked for (compiled for a GPU).
    """
    why = triton_why_off(device_type)
    if why is not None:
        raise RuntimeError(f"Carousel's Triton kernels do not run here: {why}")
    package = importlib.import_module(TRITON_PACKAGE)
    if device_type == "cpu" and not package.interpreted():
        raise RuntimeError(
            "Carousel's Triton kernels were imported before TRITON_INTERPRET=1 was set: "
            "on the CPU they run only in Triton's interpreter"
        )
    return package


def _cpu_package() -> ModuleType:
    package = _package("cpu")
    if package is None:
        raise RuntimeError(f"Carousel's CPU kernels are not here: {why_off('cpu')}")
    return package


def packable(weight: torch.Tensor) -> bool:
    """Whether the CPU kernels' `linear` can take this (N, K) weight."""
    package = _package("cpu")
    return package is not None and bool(package.packable(weight))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the CPU kernels' `linear` tile layout."""
    packed: torch.Tensor = _cpu_package().pack_weight(weight)
    return packed


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gate and up weights packed together for `linear_silu_mul`."""
    packed: torch.Tensor = _cpu_package().pack_gate_up(gate, up)
    return packed


def pack_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """`bias` as the CPU kernels' `linear` takes it."""
    packed: torch.Tensor | None = _cpu_package().pack_bias(bias, out_features)
    return packed


# torch's maintained weight-only kernels (aten ops, no build): int4 with a scale and zero per
# group along K, int8 with a scale per output channel. Named here so that compiled code keeps
# one import point; the CPU and CUDA int4 ops take differently packed weights.


def pack_int4(qweight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(N, K) codes in [0, 15] (uint8) in the layout `int4_mm` takes on `device`."""
    if device.type == "cuda":
        nibbles = (qweight[:, ::2] << 4 | qweight[:, 1::2]).to(torch.uint8)  # (N, K/2)
        k = qweight.shape[1]
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), inner_k_tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(qweight.to(torch.int32), 1)


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """`x @ w.T` with w = (q - 8) * scale + zero per group; `scales_and_zeros` (K/g, N, 2)."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x @ (qweight * scales[:, None]).T`: int8 (N, K) weights, one scale per output channel."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)
