"""The base of the layer ops: one implementation per device, chosen once at load (vLLM's
`CustomOp`), so the forward has one path and a new device is one more method."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


class CustomOp:
    """An op with a reference `forward_native` (plain torch) and per-device implementations.

    `kernels` is the compiled kernel module for `device` (backends/torch/kernels.py), or None:
    then, or where `supports_kernels` says no, every call runs `forward_native`.
    """

    def __init__(self, device: torch.device, kernels: ModuleType | None) -> None:
        self.kernels = kernels if kernels is not None and self.supports_kernels() else None
        self._forward = self.dispatch_forward(device)

    def supports_kernels(self) -> bool:
        """Whether the compiled kernels compute what `forward_native` does for this op."""
        return True

    @property
    def uses_kernels(self) -> bool:
        """Whether the implementation chosen at load is a compiled kernel's."""
        return self._forward != self.forward_native

    def dispatch_forward(self, device: torch.device) -> Callable[..., Any]:
        """The implementation every call of this op runs (chosen once)."""
        if self.kernels is None:
            return self.forward_native
        if device.type == "cpu":
            return self.forward_cpu
        if device.type == "cuda":
            return self.forward_cuda
        return self.forward_native

    def forward_native(self, *args: Any) -> Any:
        """The reference: plain torch ops, on any device."""
        raise NotImplementedError

    def forward_cpu(self, *args: Any) -> Any:
        return self.forward_native(*args)

    def forward_cuda(self, *args: Any) -> Any:
        return self.forward_native(*args)
