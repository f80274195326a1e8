"""Paged KV block accounting: reference-counted blocks and an optional prefix cache.

Blocks are handed out from a free list and never over-committed. With prefix caching on, a
block whose slots are all computed is registered under a hash of its token ids chained to
its parent block's hash; a later sequence whose tokens start the same way takes a reference
on it instead of computing it again. A registered block whose last holder frees it stays
cached (evictable) until an allocation needs the space, least recently used first. KV cache
groups (a table per group; sliding-window groups drop the blocks behind their window) are
window_blocks.py's part of the manager.
"""

from __future__ import annotations

import collections
from collections import OrderedDict, deque
from collections.abc import Iterable

from schedulers import defaults
from schedulers.kv_blocks import (
    NO_BLOCK,
    NO_HIT,
    ROOT_HASH,
    CachedBlock,
    PrefixHit,
    blocks_for,
    hash_block_tokens,
    require,
)
from schedulers.sequence import Sequence
from schedulers.window_blocks import WindowBlocks

__all__ = ["NO_BLOCK", "NO_HIT", "ROOT_HASH", "BlockManager", "PrefixHit", "blocks_for",
           "hash_block_tokens"]  # fmt: skip


class BlockManager(WindowBlocks):
    """Allocator over `num_blocks` KV blocks of `block_size` slots, with ownership.

    A block is truly free, cached (registered, no holder, evictable) or in use (one reference
    per block table holding it). `num_free_blocks` counts what an allocation can take: truly
    free plus cached; truly free blocks go first, then the least recently used cached one.

    NOTE: only registered (full, computed, hashed) blocks are ever in two tables, and no
    slot of a registered block is ever written again: a sequence writes only its blocks at
    and after `num_computed_tokens // block_size`, which are its own.
    NOTE: with `enable_prefix_caching=False` nothing is registered and block ids are handed
    out and taken back in exactly the order of a plain FIFO free list.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = defaults.BLOCK_SIZE,
        *,
        enable_prefix_caching: bool = False,
        windows: tuple[int, ...] = (),
    ) -> None:
        """`windows`: the sliding window (tokens) of each window group (module docstring);
        (): one group, every layer full attention."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if any(w < 1 for w in windows):
            raise ValueError(f"sliding windows must be positive, got {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # no KV worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, least recent first
        self._ref_counts = [0] * num_blocks
        self._cached: dict[int, CachedBlock] = {}  # registered block id -> what it holds
        self._by_hash: dict[int, int] = {}  # block hash -> registered block id
        self._window_by_hash: list[dict[int, int]] = [{} for _ in windows]  # per window group
        self._anchored: dict[int, list[int]] = {}  # full group block -> window blocks on it
        self._num_registered: dict[int, int] = {}  # seq_id -> leading table blocks handled
        #: tokens looked up at admission, and of those found in the cache (cumulative)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus cached (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds that still keep a cached prefix (part of the free)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    # -- the prefix cache ----------------------------------------------------------------------

    def computed_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest run of cached full blocks starting `seq`'s tokens; changes no block.

        At least one token is always left to compute (so there are logits to sample from):
        when every full block of the tokens is cached and they end on a block boundary, the
        last block is not used. `seq` must hold no blocks yet; fills `seq.block_hashes`.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks")
        bs = self.block_size
        max_blocks = max(0, (seq.num_tokens - 1) // bs)
        hashes = self._block_hashes(seq, max_blocks)
        block_ids: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            block_id = self._lookup(hashes[i], self._tokens_of(seq, i), parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            parent = block_id
        hit = PrefixHit(tuple(block_ids), len(block_ids) * bs)
        return self._window_hit(seq, hit) if self.windows else hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has newly filled; call after `num_computed_tokens` grows.

        A block whose prefix another block already caches is swapped for that one (its own
        copy is freed), so sequences with equal tokens end up sharing their full blocks.
        """
        if not self.enable_prefix_caching:
            return
        table = seq.block_table
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            parent = table[i - 1] if i else None
            if parent is not None and parent not in self._cached:
                break  # a collision left the parent private: nothing after it can be found
            block_hash, token_ids = hashes[i], self._tokens_of(seq, i)
            existing = self._by_hash.get(block_hash)
            if existing is None:
                self._cached[table[i]] = CachedBlock(block_hash, token_ids, parent)
                self._by_hash[block_hash] = table[i]
            elif existing != table[i] and self._lookup(block_hash, token_ids, parent) is not None:
                self._take_ref(existing)
                self._release(table[i])
                table[i] = existing
            # else another prefix holds this hash: the block stays private, uncached
        for group, window_table in enumerate(seq.window_tables):
            self._cache_window_blocks(seq, group, window_table, start, num_full, hashes)
        self._num_registered[seq.seq_id] = num_full

    # -- allocation ----------------------------------------------------------------------------

    def num_new_blocks(
        self, seq: Sequence, num_tokens: int, prefix: PrefixHit | None = None
    ) -> int:
        """Free blocks an allocation covering `seq`'s first `num_tokens` slots would take.

        With `prefix` (a hit for a sequence holding no blocks), its blocks are not counted,
        except cached ones no one holds: taking them takes them out of the free count too.
        """
        return max(0, sum(self._new_blocks_by_group(seq, num_tokens, prefix)))

    def num_reserved_blocks(
        self, seq: Sequence, num_tokens: int, step_tokens: int, prefix: PrefixHit | None = None
    ) -> int:
        """The most free blocks `seq` takes at any time on its way to its first `num_tokens`
        slots, if no step of it computes more than `step_tokens` tokens: `num_new_blocks`
        with each window group's share capped by the blocks its window and one step span
        (`window_peak`; a static batch's worst-case reservation).

        Capped, a window group's share counts every block of a prefix hit there, the ones
        another sequence holds too: that one may drop them (its window moved on) while this
        one still holds them, so a share that left them out would no longer cover what this
        sequence holds at once (the full group never drops a block, so its count may)."""
        full, *windows = self._new_blocks_by_group(seq, num_tokens, prefix, shared_windows=True)
        capped = [min(n, self.window_peak(g, step_tokens)) for g, n in enumerate(windows)]
        return max(0, full + sum(capped))

    def _new_blocks_by_group(
        self,
        seq: Sequence,
        num_tokens: int,
        prefix: PrefixHit | None,
        *,
        shared_windows: bool = False,
    ) -> list[int]:
        """`num_new_blocks`' count per group, the full one first (a window group's may be
        negative: the blocks it drops free more than it takes); `shared_windows`: a window
        group's count takes every block of the hit there, others' too, not only the cached
        ones no one holds."""
        num_blocks = blocks_for(num_tokens, self.block_size)
        if prefix is None:
            counts = [max(0, num_blocks - len(seq.block_table))]
            tables = seq.window_tables or [[] for _ in self.windows]
            computed = seq.num_computed_tokens
            for group, table in enumerate(tables):  # a dropped block frees one for the next
                counts.append(
                    max(0, num_blocks - len(table)) - self._droppable(group, table, computed)
                )
            return counts
        self._check_prefix(seq, num_tokens, prefix)
        held = len(prefix.block_ids)
        counts = [
            num_blocks - held + (len(ids) if group > 0 and shared_windows else self._unheld(ids))
            for group, ids in enumerate((prefix.block_ids, *prefix.window_block_ids))
        ]
        return counts + [num_blocks - held] * (len(self.windows) - len(prefix.window_block_ids))

    def _unheld(self, block_ids: tuple[int, ...]) -> int:
        """How many of `block_ids` no sequence holds (cached only: taking one takes it out of
        the free count)."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        return self.num_new_blocks(seq, num_tokens, prefix) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, prefix: PrefixHit | None = None) -> None:
        """Grow `seq`'s block table to cover its first `num_tokens` slots.

        With `prefix` (from `computed_prefix`, for a sequence holding no blocks), the table
        starts with the hit's blocks, one reference taken on each, and `num_computed_tokens`
        starts at the end of the hit; the lookup is counted in the prefix-cache counters.
        """
        needed = self.num_new_blocks(seq, num_tokens, prefix)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, have {self.num_free_blocks}")
        if prefix is not None:
            self._start_from(seq, prefix)
        if self.windows and not seq.window_tables:
            seq.window_tables = [[] for _ in self.windows]
        self._drop_out_of_window(seq)
        num_blocks = blocks_for(num_tokens, self.block_size)
        for table in (seq.block_table, *seq.window_tables):
            while len(table) < num_blocks:
                table.append(self._take_free_block())

    def can_append(self, seq: Sequence) -> bool:
        """Whether one more slot (the next decode token) fits."""
        return self.can_allocate(seq, seq.num_computed_tokens + 1)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_computed_tokens + 1)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s reference on each of its blocks; registered ones stay cached.

        A sequence's blocks are freed last first, so the end of a cached prefix is evicted
        before its beginning (a later block is useless without the blocks before it).
        """
        table = seq.block_table
        for block_id in reversed(table) if self.enable_prefix_caching else table:
            self._release(block_id)
        for window_table in seq.window_tables:
            for block_id in window_table:
                if block_id != NO_BLOCK:
                    self._release(block_id)
        seq.block_table = []
        seq.window_tables = []
        self._num_registered.pop(seq.seq_id, None)

    # -- internals ---------------------------------------------------------------------------

    def _tokens_of(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids(i * self.block_size, (i + 1) * self.block_size))

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """`seq.block_hashes`, extended to cover its first `num_blocks` full blocks."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block_tokens(parent, self._tokens_of(seq, len(hashes))))
        return hashes

    def _lookup(
        self, block_hash: int, token_ids: tuple[int, ...], parent: int | None
    ) -> int | None:
        """The registered block holding `token_ids` right after block `parent`, if any."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        cached = self._cached[block_id]
        if cached.parent != parent or cached.token_ids != token_ids:
            return None
        return block_id

    def _check_prefix(self, seq: Sequence, num_tokens: int, prefix: PrefixHit) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id} must start from a prefix holding no blocks")
        if num_tokens < prefix.num_tokens:
            raise ValueError(f"{num_tokens} slots do not cover the {prefix.num_tokens}-token hit")
        if prefix.num_tokens != len(prefix.block_ids) * self.block_size:
            raise ValueError("a prefix hit is made of whole blocks")
        if prefix.block_ids and len(prefix.window_block_ids) != len(self.windows):
            raise ValueError("a prefix hit names the blocks of every window group")
        parent: int | None = None
        for i, block_id in enumerate(prefix.block_ids):
            block_hash = self._block_hashes(seq, i + 1)[i]
            if self._lookup(block_hash, self._tokens_of(seq, i), parent) != block_id:
                raise RuntimeError(f"stale prefix hit for seq {seq.seq_id}: look it up again")
            parent = block_id
        held = len(prefix.block_ids)
        for group, ids in enumerate(prefix.window_block_ids):
            first = held - len(ids)
            if first != self.window_start(group, prefix.num_tokens) or any(
                self._window_lookup(group, seq, first + j, prefix.block_ids[first + j]) != b
                for j, b in enumerate(ids)
            ):
                raise RuntimeError(f"stale prefix hit for seq {seq.seq_id}: look it up again")

    def _start_from(self, seq: Sequence, prefix: PrefixHit) -> None:
        for block_id in prefix.block_ids:
            self._take_ref(block_id)
        seq.block_table = list(prefix.block_ids)
        held = len(prefix.block_ids)
        windows = prefix.window_block_ids or tuple(() for _ in self.windows)
        seq.window_tables = [[NO_BLOCK] * (held - len(ids)) + list(ids) for ids in windows]
        for ids in windows:
            for block_id in ids:
                self._take_ref(block_id)
        seq.num_computed_tokens = prefix.num_tokens
        self._num_registered[seq.seq_id] = len(prefix.block_ids)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += prefix.num_tokens

    def _take_ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._cached:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _take_free_block(self) -> int:
        """A truly free block, else the least recently used cached one (evicted)."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            # NOTE: it has no cached child: a child's holders hold its parent, and a parent
            # is freed after its children, so it is always the more recently used
            self._uncache(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _uncache(self, block_id: int) -> None:
        """Forget what `block_id` caches (evicted); a full group block's anchored window
        blocks go with it (a held one stays held, uncached; an evictable one is free)."""
        cached = self._cached.pop(block_id)
        if cached.group == 0:
            del self._by_hash[cached.block_hash]
            for window_block in self._anchored.pop(block_id, ()):
                window = self._cached.pop(window_block)
                del self._window_by_hash[window.group - 1][window.block_hash]
                if self._ref_counts[window_block] == 0:
                    del self._evictable[window_block]
                    self._free.append(window_block)
            return
        del self._window_by_hash[cached.group - 1][cached.block_hash]
        assert cached.parent is not None
        anchored = self._anchored[cached.parent]
        anchored.remove(block_id)
        if not anchored:
            del self._anchored[cached.parent]

    # -- checks --------------------------------------------------------------------------------

    def check_invariants(self, holders: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError when the accounting is inconsistent.

        `holders`: every sequence that holds blocks; their tables are then checked against
        the reference counts, the sharing rule and the cached blocks' contents.
        """
        free, evictable = list(self._free), list(self._evictable)
        refs = self._ref_counts
        require(min(refs) >= 0, "a reference count is below zero")
        in_use = [b for b in range(self.num_blocks) if refs[b] > 0]
        require(
            len(free) + len(evictable) + len(in_use) == self.num_blocks,
            "free + cached + in use != total",
        )
        require(len(set(free) | set(evictable)) == len(free) + len(evictable), "double free")
        require(all(refs[b] == 0 and b not in self._cached for b in free), "bad free block")
        require(all(refs[b] == 0 and b in self._cached for b in evictable), "bad cached block")
        require(self.enable_prefix_caching or not self._cached, "cached with caching off")
        self._check_cache(evictable)
        if holders is not None:
            self._check_holders(list(holders))

    def _check_cache(self, evictable: list[int]) -> None:
        indexes = [self._by_hash, *self._window_by_hash]
        require(sum(map(len, indexes)) == len(self._cached), "hash index out of step")
        require(
            all(
                self._cached[b].block_hash == h and self._cached[b].group == group
                for group, index in enumerate(indexes)
                for h, b in index.items()
            ),
            "a hash names the wrong block",
        )
        lru_rank = {b: rank for rank, b in enumerate(evictable)}
        for block_id, cached in self._cached.items():
            require(len(cached.token_ids) == self.block_size, "a partial block is cached")
            parent = cached.parent
            if cached.group:  # a window group's: anchored beside a full group block
                anchor = self._cached.get(parent) if parent is not None else None
                require(
                    anchor is not None and anchor.group == 0
                    and anchor.token_ids == cached.token_ids
                    and block_id in self._anchored.get(parent, ()),  # type: ignore[arg-type]
                    f"window block {block_id} lost its anchor",
                )  # fmt: skip
                continue
            if parent is None:
                continue
            require(parent in self._cached, f"cached block {block_id} lost its parent")
            require(self._ref_counts[parent] >= self._ref_counts[block_id], "orphan holder")
            if block_id in lru_rank and parent in lru_rank:
                require(lru_rank[parent] > lru_rank[block_id], "a parent would evict first")

    def _check_holders(self, holders: list[Sequence]) -> None:
        counts = collections.Counter(
            b
            for seq in holders
            for table in (seq.block_table, *seq.window_tables)
            for b in table
            if b != NO_BLOCK
        )
        require(
            all(counts[b] == self._ref_counts[b] for b in range(self.num_blocks)),
            "reference counts differ from the block tables",
        )
        for seq in holders:
            self._check_window_tables(seq, counts)
            table = seq.block_table
            require(len(set(table)) == len(table), f"seq {seq.seq_id} holds a block twice")
            num_full = seq.num_computed_tokens // self.block_size
            for i, block_id in enumerate(table):
                cached = self._cached.get(block_id)
                if i >= num_full:  # the slots this sequence may still write
                    require(cached is None and counts[block_id] == 1, "a writable block shared")
                elif cached is not None:
                    require(
                        cached.token_ids == self._tokens_of(seq, i)
                        and cached.parent == (table[i - 1] if i else None),
                        f"seq {seq.seq_id} holds a cached block of another prefix",
                    )
                else:
                    require(counts[block_id] == 1, "an uncached block shared")
