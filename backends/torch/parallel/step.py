"""One step's flat metadata, as rank 0 broadcasts it and every rank rebuilds its forward input.

Everything the forward needs is a few int64 arrays (what runner.py `prepare` builds): token
ids, positions, slot mapping, cu_seqlens_q, context lengths, block tables and the rows to
compute logits for. They travel as one int64 buffer behind a fixed-size header, and every
rank (rank 0 included) rebuilds the `BatchLayout` from them with the same code as
`prepare_inputs` (inputs.py `build_layout`), so all
ranks run exactly the same forward over the same block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.torch.runner.inputs import ModelInput, build_layout

#: header: [kind, instance id, tokens N, sequences B, block-table width W, logits rows R]
HEADER_LEN = 6


@dataclass(frozen=True)
class FlatStep:
    """The flat inputs of one forward (host int64 tensors). `logits_indices` None: all rows."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    slot_mapping: torch.Tensor  # (N,)
    cu_seqlens_q: torch.Tensor  # (B + 1,)
    context_lens: torch.Tensor  # (B,)
    block_tables: torch.Tensor  # (B, W)
    logits_indices: torch.Tensor | None  # (R,)

    @classmethod
    def of(cls, inputs: ModelInput, rows: list[int] | None) -> FlatStep:
        layout = inputs.layout
        return cls(
            input_ids=inputs.input_ids.cpu(),
            positions=inputs.positions.cpu(),
            slot_mapping=layout.slot_mapping.cpu(),
            cu_seqlens_q=layout.cu_seqlens_q.cpu(),
            context_lens=layout.context_lens.cpu(),
            block_tables=layout.block_tables.cpu(),
            logits_indices=None if rows is None else torch.tensor(rows, dtype=torch.long),
        )

    @property
    def sizes(self) -> list[int]:
        """[N, B, W, R] (R = -1: logits for every sequence)."""
        rows = -1 if self.logits_indices is None else self.logits_indices.numel()
        b, w = self.block_tables.shape
        return [self.input_ids.numel(), b, w, rows]

    def pack(self) -> torch.Tensor:
        parts = [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.cu_seqlens_q,
            self.context_lens,
            self.block_tables.reshape(-1),
        ]
        if self.logits_indices is not None:
            parts.append(self.logits_indices)
        return torch.cat([p.to(torch.long) for p in parts])

    @staticmethod
    def packed_len(sizes: list[int]) -> int:
        n, b, w, r = sizes
        return 3 * n + (b + 1) + b + b * w + max(r, 0)

    @classmethod
    def unpack(cls, sizes: list[int], buffer: torch.Tensor) -> FlatStep:
        n, b, w, r = sizes
        parts = torch.split(buffer, [n, n, n, b + 1, b, b * w, max(r, 0)])
        return cls(
            input_ids=parts[0],
            positions=parts[1],
            slot_mapping=parts[2],
            cu_seqlens_q=parts[3],
            context_lens=parts[4],
            block_tables=parts[5].view(b, w),  # (B, W)
            logits_indices=parts[6] if r >= 0 else None,
        )

    def model_input(
        self, block_size: int, device: torch.device
    ) -> tuple[ModelInput, torch.Tensor | None]:
        """The forward's inputs on `device`, and its logits rows (None: every sequence)."""
        layout = build_layout(
            self.cu_seqlens_q,
            self.context_lens,
            self.slot_mapping,
            self.block_tables,
            block_size,
            device,
        )
        inputs = ModelInput(
            input_ids=self.input_ids.to(device), positions=self.positions.to(device), layout=layout
        )
        rows = None if self.logits_indices is None else self.logits_indices.to(device)
        return inputs, rows
