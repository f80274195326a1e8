"""Each sequence's token ids as one numpy array, appended to as the sequence grows."""

from __future__ import annotations

import numpy as np

from schedulers.sequence import Sequence

#: room a new buffer leaves past the sequence's current tokens
_HEADROOM = 256


class TokenHistory:
    """Prompt + output ids of every sequence asked about, in growing int64 arrays.

    A step copies only the tokens appended since the sequence was last seen (amortised: a
    buffer doubles when full), so asking for an 8k-token context each step costs the new
    tokens, not 8k. NOTE: relies on a sequence's tokens only ever being appended (as the
    block manager's hashes do); a sequence that is shorter than its buffer is read again.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}
        self._lengths: dict[int, int] = {}

    def tokens(self, seq: Sequence) -> np.ndarray:
        """`seq`'s prompt + output ids (a view, valid until the next call for `seq`)."""
        seen = self._lengths.get(seq.seq_id, 0)
        total = seq.num_tokens
        if total < seen:
            seen = 0
        buffer = self._room(seq.seq_id, total)
        if total > seen:
            buffer[seen:total] = seq.token_ids(seen, total)
            self._lengths[seq.seq_id] = total
        return buffer[:total]

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self._buffers.pop(seq_id, None)
        self._lengths.pop(seq_id, None)

    def _room(self, seq_id: int, total: int) -> np.ndarray:
        """The sequence's buffer, grown (doubled, contents kept) to hold `total` tokens."""
        buffer = self._buffers.get(seq_id)
        if buffer is not None and buffer.shape[0] >= total:
            return buffer
        capacity = total + _HEADROOM if buffer is None else max(2 * buffer.shape[0], total)
        grown = np.empty(capacity, dtype=np.int64)
        if buffer is not None:
            kept = self._lengths.get(seq_id, 0)
            grown[:kept] = buffer[:kept]
        self._buffers[seq_id] = grown
        return grown
