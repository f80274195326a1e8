"""What one engine's paged KV cache holds, in the figures vLLM prints at start-up.

vLLM logs "# GPU blocks: N" and "Maximum concurrency for X tokens per request: Yx"; Carousel
logs the same figures once per local arm (`kv_cache`, gateway/state.py) and exports them in
/metrics (gateway/obs/metrics.py), so an operator sees what the server can hold before the
first request, and a dashboard sees it beside the usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedulers.backend import KVCacheSpec
from schedulers.block_manager import blocks_for

#: the context length of a "typical" request, the second concurrency figure (capped by
#: `max_model_len`: a deployment that serves less has no request of this length)
TYPICAL_CONTEXT_TOKENS = 2048
GIB = 1024**3


@dataclass(frozen=True)
class KVCapacity:
    """One engine's KV cache: `num_blocks` blocks of `block_size` token slots, `nbytes` of
    K and V tensors (0: the backend holds none, the sim), serving `max_model_len` tokens."""

    num_blocks: int
    block_size: int
    nbytes: int
    max_model_len: int
    #: the window groups' sliding windows (KVCacheSpec.windows): a block then holds one
    #: group's layers, and a request one table of blocks per group
    windows: tuple[int, ...] = ()

    @classmethod
    def of(cls, spec: KVCacheSpec, max_model_len: int) -> KVCapacity:
        nbytes = spec.num_blocks * spec.bytes_per_block
        return cls(spec.num_blocks, spec.block_size, nbytes, max_model_len, spec.windows)

    @property
    def num_tokens(self) -> int:
        """Token slots of the whole cache: with window groups, the tokens it holds when every
        group holds every token (contexts within the windows; longer ones hold more)."""
        return self.num_blocks * self.block_size // (1 + len(self.windows))

    @property
    def typical_context_tokens(self) -> int:
        return min(TYPICAL_CONTEXT_TOKENS, self.max_model_len)

    def max_concurrency(self, context_tokens: int) -> float:
        """How many requests of `context_tokens` tokens (prompt and output) fit at once.

        NOTE: as vLLM v1 computes its "Maximum concurrency" line: the cache's blocks over the
        blocks one such request holds (`ceil(context / block_size)`, a part-filled last block
        counts whole), so it equals tokens / context when the context is a whole number of
        blocks. A ratio, not a count of slots: it assumes no prefix is shared (a shared
        prefix's blocks are held once, so more fit) and no request is shorter. With window
        groups a request holds, beside its full table, each window group's blocks of its
        window while it decodes (`ceil(window / block_size) + 1` at most).
        """
        held = blocks_for(context_tokens, self.block_size)
        for window in self.windows:
            held += min(
                blocks_for(context_tokens, self.block_size), blocks_for(window, self.block_size) + 1
            )
        return self.num_blocks / held

    def log_fields(self) -> dict[str, Any]:
        """The `kv_cache` start-up log line's fields."""
        fields: dict[str, Any] = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
        }
        if self.nbytes:
            fields["gib"] = round(self.nbytes / GIB, 3)
        if self.windows:
            fields["window_groups"] = list(self.windows)
        typical = self.typical_context_tokens
        fields["max_model_len"] = self.max_model_len
        fields["max_concurrency"] = f"{self.max_concurrency(self.max_model_len):.2f}x"
        fields["typical_context"] = typical
        fields["typical_concurrency"] = f"{self.max_concurrency(typical):.2f}x"
        return fields
