"""Per-sequence token counts kept on the device, updated with only the tokens new since the
last step: what the repetition, presence and frequency penalties read.

Counting every row's whole token list again each step (one copy of all its ids to the
device, a device-side sum to size the update) cost a host sync and O(tokens) work a step;
here each counted list has a row of one persistent `[slots, V]` float32 tensor, and a step
sends only the ids appended since (one copy for the whole batch) and adds them with one
`index_put_`. Counts are exact integers in float32, the same values the full recount gave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: (seq_id, which list): "all" (prompt + output, repetition) or "output" (presence, frequency)
Key = tuple[int, str]


@dataclass
class _Slot:
    row: int
    owner: object  # the sequence counted (a different one under the same key starts afresh)
    counted: int  # tokens of the list already in the row


class TokenCounts:
    """Rows of token counts by (sequence, list), grown on demand (module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, device=self.device)
        self._slots: dict[Key, _Slot] = {}
        self._free: list[int] = []

    def rows(
        self, keys: list[Key], token_lists: list[list[int]], owners: list[object]
    ) -> torch.Tensor:
        """The counts [R, V] of each `token_lists[r]`, the row of `keys[r]` (counting the
        tokens of `owners[r]`) brought up to date.

        A row counted for another owner, or a list shorter than what its row counted (never
        in the engine: tokens are only appended), is counted again from scratch.
        """
        slot_rows: list[int] = []
        new_ids: list[int] = []
        for key, tokens, owner in zip(keys, token_lists, owners, strict=True):
            slot = self._slots.get(key)
            if slot is None or slot.owner is not owner or len(tokens) < slot.counted:
                slot = self._take(key, owner)
            new = tokens[slot.counted :]
            slot_rows += [slot.row] * len(new)
            new_ids += new
            slot.counted = len(tokens)
        if new_ids:
            index = torch.tensor([slot_rows, new_ids], dtype=torch.long).to(
                self.device, non_blocking=True
            )  # (2, M): one copy for the whole batch
            valid = (index[1] >= 0) & (index[1] < self.vocab_size)
            ids = index[1].clamp(0, self.vocab_size - 1)
            # NOTE: an id outside the vocabulary adds 0 where it lands: no data-sized update
            self.counts.index_put_((index[0], ids), valid.to(self.counts.dtype), accumulate=True)
        rows = torch.tensor([self._slots[key].row for key in keys], dtype=torch.long)
        return self.counts[rows.to(self.device, non_blocking=True)]

    def release(self, seq_id: int) -> None:
        """Free the rows of a finished sequence."""
        for which in ("all", "output"):
            slot = self._slots.pop((seq_id, which), None)
            if slot is not None:
                self._free.append(slot.row)

    def _take(self, key: Key, owner: object) -> _Slot:
        old = self._slots.pop(key, None)
        if old is not None:
            self._free.append(old.row)
        if not self._free:
            grown = max(8, 2 * self.counts.shape[0])
            counts = torch.zeros(grown, self.vocab_size, device=self.device)
            counts[: self.counts.shape[0]] = self.counts
            self._free = list(range(grown - 1, self.counts.shape[0] - 1, -1))
            self.counts = counts
        slot = _Slot(self._free.pop(), owner, 0)
        self.counts[slot.row].zero_()
        self._slots[key] = slot
        return slot
