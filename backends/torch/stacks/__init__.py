"""The decoder-layer stacks: what runs every layer of a step, chosen once when the model is
built (`PagedCausalLM`, model.py), never reset afterwards.

- `eager` (eager.py): the layer ops (layers/, attention/) called one by one from Python; it
  runs every step.
- `native` (native.py): a decode-only step's layers in one call of Carousel's C++ `DecodeStack`,
  bit for bit the eager loop; every other step eager. Chosen where Carousel's CPU kernels run
  every op of the layer and nothing sits between them (no tensor parallelism).
- `compiled` (compiled.py): every step through one `torch.compile`d layer function
  (`--compile`), the weights as arguments.

Each stack declares the steps it takes (`takes`); a step it does not take runs eager.
The choice's inputs are the config (`--compile`, `native_layers`), tensor parallelism and the
kernels' availability for the device and dtype (`choose_stack`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from backends.torch.attention.base import AttentionMetadata

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), (N, 1, hd) each


class LayerStack(Protocol):
    """Every decoder layer over one step: (hidden, rope, meta) -> hidden."""

    name: str

    def __call__(
        self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> torch.Tensor: ...
