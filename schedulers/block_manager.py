"""Paged KV block accounting: hands out fixed-size blocks, never over-commits."""

from __future__ import annotations

from collections import deque

from schedulers.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` token slots."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Free-list allocator over `num_blocks` KV blocks of `block_size` slots.

    NOTE: a sequence's block table covers at least every token it has scheduled; a block
    id is in exactly one block table or in the free list, never both.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks for a table covering its first `num_tokens` slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to cover its first `num_tokens` slots."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {needed}, have {len(self._free)}")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more slot (the next decode token) fits."""
        return self.can_allocate(seq, seq.num_computed_tokens + 1)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_computed_tokens + 1)

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` to the free list."""
        self._free.extend(seq.block_table)
        seq.block_table = []
