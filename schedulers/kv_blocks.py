"""The block manager's vocabulary: block counts, chained block hashes, prefix hits, and what
a registered block holds (block_manager.py; window_blocks.py for the window groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

#: the parent hash of a sequence's first block
ROOT_HASH = 0
#: a window table's entry for a block dropped out of the window (never read: it is masked)
NO_BLOCK = -1


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` token slots."""
    return -(-num_tokens // block_size)


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block's token ids chained to its parent's (equal prefixes, equal hash).

    A lookup key only: every hit is verified on the block's token ids and parent block, so
    a collision costs a miss, never wrong KV.
    """
    return hash((parent_hash, *token_ids))


class PrefixHit(NamedTuple):
    """The longest cached prefix of a sequence: its block ids and the tokens they hold.

    `window_block_ids[g]`: window group g's blocks of the hit's last window (the table's
    entries from `window_start`, the ones before it dropped). Valid until the block manager
    next changes (allocate, append, free, cache_full_blocks).
    """

    block_ids: tuple[int, ...]
    num_tokens: int
    window_block_ids: tuple[tuple[int, ...], ...] = ()


NO_HIT = PrefixHit((), 0)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a registered block holds: `token_ids` after the prefix ending in `parent`."""

    block_hash: int
    token_ids: tuple[int, ...]
    #: the block id before it in the prefix (None for a first block); in a window group, the
    #: full group's block of the same tokens (its anchor)
    parent: int | None
    group: int = 0  # its KV cache group (0: the full-attention layers')


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
