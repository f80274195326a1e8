"""KV cache groups (vLLM's hybrid KV cache manager): a model whose layers attend either to
everything or to a sliding window (Gemma 2 and 3, ...) keeps its sliding layers' K/V in
blocks of their own. The backend splits the layers into groups of equally many (its
`KVCacheSpec.windows`); every block of the pool holds one group's layers, so a sequence has a
block table per group: `block_table` for the full-attention layers, `window_tables[g]` for
sliding group g. A window table drops (`NO_BLOCK`) the blocks that lie wholly before the
window of the next token to compute, so a long sequence holds its window's blocks there, not
its whole context. Dropped blocks stay cached like any other; a prefix hit needs, in each
window group, the blocks of the window before its end (the earlier ones are never read). A
window group's cached block is anchored to the full group's cached block of the same tokens
(its `parent`): a hit takes it only beside that block, found through the chain of parents,
so a hash collision costs a miss there too; and it is uncached when its anchor is evicted.

`WindowBlocks` is the block manager's part that handles the window groups (BlockManager
inherits it): where a window starts, the blocks it drops, and the window groups' share of
the prefix cache. It reads the manager's pool and cache and calls its reference counting.
"""

from __future__ import annotations

import collections

from schedulers.kv_blocks import (
    NO_BLOCK,
    NO_HIT,
    CachedBlock,
    PrefixHit,
    blocks_for,
    require,
)
from schedulers.sequence import Sequence


class WindowBlocks:
    """The window groups of a block manager (see the module docstring)."""

    windows: tuple[int, ...]
    block_size: int
    _ref_counts: list[int]
    _cached: dict[int, CachedBlock]
    _window_by_hash: list[dict[int, int]]
    _anchored: dict[int, list[int]]

    def _take_ref(self, block_id: int) -> None:
        raise NotImplementedError

    def _release(self, block_id: int) -> None:
        raise NotImplementedError

    def _tokens_of(self, seq: Sequence, i: int) -> tuple[int, ...]:
        raise NotImplementedError

    def window_start(self, group: int, position: int) -> int:
        """The first block of window group `group` a token at `position` reads (the one
        holding its window's first key, `position - window + 1`)."""
        return max(0, (position - self.windows[group] + 1) // self.block_size)

    def window_peak(self, group: int, step_tokens: int) -> int:
        """The most blocks window group `group` holds for a sequence none of whose steps
        computes more than `step_tokens` tokens: a step from position c holds the blocks
        from `window_start(c)` (position c - window + 1) to that of position
        c + step_tokens - 1, window + step_tokens - 1 positions, which span at most
        blocks_for(window + step_tokens - 2) + 1 blocks."""
        return blocks_for(step_tokens + self.windows[group] - 2, self.block_size) + 1

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens can hold: every group's, as when
        its whole prompt runs in one step (no window block dropped yet)."""
        return blocks_for(num_tokens, self.block_size) * (1 + len(self.windows))

    def _droppable(self, group: int, table: list[int], computed: int) -> int:
        """Blocks that dropping `table`'s blocks before the window of position `computed`
        frees (those no other table holds)."""
        i = min(self.window_start(group, computed), len(table)) - 1
        count = 0
        while i >= 0 and table[i] != NO_BLOCK:  # dropped blocks are always a leading run
            count += self._ref_counts[table[i]] == 1
            i -= 1
        return count

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Release each window table's blocks before the next token's window (its cached
        ones stay cached)."""
        computed = seq.num_computed_tokens
        for group, table in enumerate(seq.window_tables):
            i = min(self.window_start(group, computed), len(table)) - 1
            while i >= 0 and table[i] != NO_BLOCK:
                self._release(table[i])
                table[i] = NO_BLOCK
                i -= 1

    def _window_lookup(self, group: int, seq: Sequence, i: int, anchor: int) -> int | None:
        """Window group `group`'s registered block holding `seq`'s block `i` beside the full
        group's block `anchor`, if any (`seq.block_hashes` covering it)."""
        block_id = self._window_by_hash[group].get(seq.block_hashes[i])
        if block_id is None:
            return None
        cached = self._cached[block_id]
        if cached.parent != anchor or cached.token_ids != self._tokens_of(seq, i):
            return None
        return block_id

    def _window_hit(self, seq: Sequence, hit: PrefixHit) -> PrefixHit:
        """`hit` cut to its longest prefix whose last window every window group caches.

        From the whole hit down: a window group missing block i rules out every prefix
        whose window holds it, so the next one tried ends at block i; each block is looked
        up at most once per group.
        """
        bs = self.block_size
        found: dict[tuple[int, int], int | None] = {}
        m = len(hit.block_ids)
        while m > 0:
            groups: list[tuple[int, ...]] = []
            for group in range(len(self.windows)):
                ids: list[int] = []
                for i in range(m - 1, self.window_start(group, m * bs) - 1, -1):
                    if (group, i) not in found:
                        found[group, i] = self._window_lookup(group, seq, i, hit.block_ids[i])
                    block_id = found[group, i]
                    if block_id is None:
                        m = i  # the longest prefix whose window leaves block i out
                        break
                    ids.append(block_id)
                else:
                    groups.append(tuple(reversed(ids)))
                    continue
                break
            else:
                return PrefixHit(hit.block_ids[:m], m * bs, tuple(groups))
        return NO_HIT

    def _cache_window_blocks(
        self,
        seq: Sequence,
        group: int,
        table: list[int],
        start: int,
        num_full: int,
        hashes: list[int],
    ) -> None:
        """`cache_full_blocks` for window group `group`'s table: only beside a cached block of
        the full group (its anchor)."""
        index = self._window_by_hash[group]
        for i in range(start, min(num_full, len(table))):
            block_id, anchor = table[i], seq.block_table[i]
            if block_id == NO_BLOCK or anchor not in self._cached:
                continue
            existing = index.get(hashes[i])
            if existing is None:
                tokens = self._tokens_of(seq, i)
                self._cached[block_id] = CachedBlock(hashes[i], tokens, anchor, group + 1)
                self._anchored.setdefault(anchor, []).append(block_id)
                index[hashes[i]] = block_id
            elif existing != block_id and self._window_lookup(group, seq, i, anchor) is not None:
                self._take_ref(existing)
                self._release(block_id)
                table[i] = existing

    def _check_window_tables(self, seq: Sequence, counts: collections.Counter[int]) -> None:
        require(
            not seq.window_tables or len(seq.window_tables) == len(self.windows),
            f"seq {seq.seq_id} has a table per window group",
        )
        for group, table in enumerate(seq.window_tables):
            require(len(table) == len(seq.block_table), "a window table of another length")
            check_window_table(self, seq, group, table, counts)


def check_window_table(
    bm: WindowBlocks, seq: Sequence, group: int, table: list[int], counts: collections.Counter[int]
) -> None:
    """`_check_holders` for one of `seq`'s window tables: dropped blocks a leading run, no
    block twice, written blocks its own, cached ones holding its tokens after its prefix."""
    real = [b for b in table if b != NO_BLOCK]
    require(table[len(table) - len(real) :] == real, f"seq {seq.seq_id} dropped a block mid-window")
    require(len(set(real)) == len(real), f"seq {seq.seq_id} holds a window block twice")
    num_full = seq.num_computed_tokens // bm.block_size
    for i, block_id in enumerate(table):
        if block_id == NO_BLOCK:
            continue
        cached = bm._cached.get(block_id)
        if i >= num_full:
            require(cached is None and counts[block_id] == 1, "a writable window block shared")
        elif cached is not None:
            require(
                cached.group == group + 1
                and cached.token_ids == bm._tokens_of(seq, i)
                and cached.parent == seq.block_table[i],
                f"seq {seq.seq_id} holds a cached window block of another prefix",
            )
        else:
            require(counts[block_id] == 1, "an uncached window block shared")
