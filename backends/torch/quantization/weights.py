"""Weight-only quantised copies of a linear's weight, for torch's int4 and int8 kernels.

`Int4Weight`: a GGUF file's own 4-bit blocks (gguf_int4.py), packed once for
`kernels.int4_mm`. `Int8Weight`: a full-precision weight quantised per output channel
(symmetric, scale = max |w| / 127) for `kernels.int8_mm`: `--quantization int8`, and the LM
head of a GGUF whose embedding is not 4-bit (SmolLM2's is Q8_0). Both compute in the
activations' dtype; `nbytes` is what they keep resident.
"""

from __future__ import annotations

import torch

from backends.torch import kernels
from backends.torch.quantization.gguf_int4 import GROUP_SIZE, Int4Blocks


class Int4Weight:
    """4-bit codes with a scale and zero per group of 32 along K (`w = (q - 8) s + z`)."""

    format = "int4"

    def __init__(self, blocks: Int4Blocks, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = blocks.qweight.shape
        self.packed = kernels.pack_int4(blocks.qweight, device)
        # (K/32, N, 2): the kernels' layout of each group's (scale, zero)
        pairs = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1)
        self.scales_and_zeros = pairs.to(device=device, dtype=dtype).contiguous()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w.T`, (M, K) -> (M, N)."""
        return kernels.int4_mm(x.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros)

    def stack_args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weight, scales, group size) as the native decode stack's `quantize` takes them."""
        return self.packed, self.scales_and_zeros, GROUP_SIZE

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros)


class Int8Weight:
    """int8 weights with one scale per output channel (symmetric, weight-only)."""

    format = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            w = weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scales.to(weight.dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w.T`, (M, K) -> (M, N)."""
        return kernels.int8_mm(x.contiguous(), self.qweight, self.scales)

    def stack_args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weight, scales, group size: 0, per output channel) for the stack's `quantize`."""
        return self.qweight, self.scales, 0

    def dequantize(self) -> torch.Tensor:
        """The (N, K) fp32 weight the kernel multiplies by."""
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.qweight) + _nbytes(self.scales)


QuantizedWeight = Int4Weight | Int8Weight


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
