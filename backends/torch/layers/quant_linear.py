"""A linear with a weight-only quantised copy: the int4 (or int8) kernel for small steps.

torch's weight-only kernels are matrix-vector kernels: their cost grows with the rows, so
they beat the full-precision weight for a quiet server's decode steps (a few rows: a quarter
to a half of the bytes to stream) and lose badly for big batches and prefill. So each call
chooses by its row count: at most `max_rows` rows take the quantised kernel, more take the
full-precision `Linear` (linear.py). Both copies stay resident. `max_rows` is measured at
load (quantization/quantize.py) or set (`--quantization-max-rows`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from backends.torch.layers.custom_op import CustomOp
from backends.torch.layers.linear import Linear


class QuantizedMatmul(Protocol):
    """A weight-only quantised copy of an (N, K) weight (quantization/weights.py)."""

    format: str
    out_features: int
    in_features: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w.T`, (M, K) -> (M, N)."""
        ...

    def stack_args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weight, scales, group size) as the native decode stack takes them."""
        ...


class QuantLinear(CustomOp):
    """`y = x @ W.T + b` through `quantized` for steps of at most `max_rows` rows.

    `forward_native`, the reference, multiplies by the full-precision weight: for a GGUF model
    that is the very same blocks dequantised (loader.py's conversion), so the two agree up to
    the kernel's rounding. `kernels` is backends/torch/kernels.py (torch's aten ops), or None.
    """

    def __init__(
        self,
        dense: Linear,
        quantized: QuantizedMatmul,
        max_rows: int,
        device: torch.device,
        kernels: ModuleType | None,
    ) -> None:
        self.dense, self.quantized, self.max_rows = dense, quantized, max_rows
        self.out_features = dense.out_features
        self.native = None  # never one of Carousel's packed kernels (stacks/native.py asks)
        super().__init__(device, kernels)

    def supports_kernels(self) -> bool:
        return self.max_rows > 0

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the quantised weight (else the full-precision one)."""
        return self.uses_kernels and x.shape[0] <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._forward(x)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        y = self.quantized.mm(x)
        return y if self.dense.bias is None else y + self.dense.bias

    forward_cuda = forward_cpu
