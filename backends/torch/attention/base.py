"""The attention seam: what every attention backend gets, and the three things it must do.

Once per step the runner builds a `BatchLayout` (where each sequence's scheduled tokens sit in
the flat batch and in the paged KV cache); the backend turns it into its own metadata
(`build_metadata`). Then, in every layer, the model hands it that layer's new Q/K/V:
`write_kv` stores K/V into the paged cache, `attend` computes attention for every token.

The KV cache layout is shared by all backends: per layer, K and V are
`[num_blocks, block_size, num_kv_heads, head_dim]` (the "NHD" paged layout of vLLM,
FlashAttention and FlashInfer), so a CUDA kernel can read the same tensors.

NOTE: head counts come from each layer's `AttentionSpec`, built from that layer's own
weights, never from the model config: a tensor-parallel rank may hold only some heads.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from backends.torch.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention as this device holds it."""

    num_heads: int  # query heads on this device
    num_kv_heads: int  # K/V heads on this device
    head_dim: int
    scale: float
    sliding_window: int | None  # a query attends to the last `sliding_window` keys; None = all

    @property
    def group_size(self) -> int:
        """Query heads sharing one K/V head (GQA maps query head h to K/V head h // g)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class BatchLayout:
    """Where each sequence's scheduled tokens sit in the flat batch and in the paged KV cache.

    Sequence `i` owns flat rows `[cu_seqlens_q[i], cu_seqlens_q[i + 1])`. After this step's
    K/V are written, its context is slots `[0, seqlens_k[i])` of its block table, the last
    `seqlens_q[i]` of which are the new tokens.

    NOTE: `block_tables` rows are padded with block 0 to a common width; nothing past a
    sequence's context length is ever attended to.
    """

    cu_seqlens_q: torch.Tensor  # (B + 1,) int64
    context_lens: torch.Tensor  # (B,) int64, == seqlens_k
    slot_mapping: torch.Tensor  # (N,) int64, cache slot of every scheduled token
    block_tables: torch.Tensor  # (B, max_blocks) int64
    query_starts: tuple[int, ...]  # host copies, to slice without device syncs
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    decode_indices: torch.Tensor  # (D,) int64, sequences with exactly one new token
    decode_max_blocks: int  # widest block table among the decodes
    prefill_indices: tuple[int, ...]  # sequences with more than one new token
    #: the same step in each window group of a KV cache with groups (kv_cache.py's
    #: `KVGroups`): its own block tables and slots, the rest shared; () with one group
    groups: tuple[BatchLayout, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_q)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class AttentionMetadata:
    """What a backend derives from one step's `BatchLayout`; backends subclass it."""

    layout: BatchLayout


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(abc.ABC, Generic[M]):
    """Paged attention for every layer of one model on one device.

    Subclasses set `name` (the registry key) and `devices`, implement `build_metadata` and
    `attend`, and answer for themselves where they run (`why_unavailable`) and whether `auto`
    takes them (`preferred_on`); `write_kv` stores into the shared cache layout and rarely
    needs overriding (an override sets `shared_kv_write` False).
    """

    name: ClassVar[str]
    #: the device types it runs on
    devices: ClassVar[tuple[str, ...]]
    #: K/V go into the cache through the shared `write_kv` (so rotary may fuse the write into
    #: its own kernel, `rotary_write_kv`)
    shared_kv_write: ClassVar[bool] = True
    #: its decodes run Carousel's CPU decode kernel: the native decode stack may run them, and
    #: `auto` leaves it out when those kernels are switched off (`cpu_kernels` False)
    native_decodes: ClassVar[bool] = False
    #: it can attend every token as a decode over its own context (`per_token`), so a token's
    #: output never depends on its step: what `batch_invariant` needs
    token_by_token: ClassVar[bool] = False

    @classmethod
    def why_unavailable(
        cls, device: torch.device, dtype: torch.dtype | None = None, head_dim: int = 0
    ) -> str | None:
        """Why it cannot run on `device` here, over a `dtype` cache and heads of `head_dim`
        (None or 0: not asked), as the end of a sentence naming it; None when it can."""
        if device.type not in cls.devices:
            return f"runs on {', '.join(cls.devices)}, not {device.type}"
        return cls.why_not_here(device, dtype, head_dim)

    @classmethod
    def why_not_here(
        cls, device: torch.device, dtype: torch.dtype | None, head_dim: int
    ) -> str | None:
        """What else keeps it off a device it runs on (its kernels, the cache dtype, the head
        size), in `why_unavailable`'s words; None: nothing."""
        return None

    @classmethod
    def preferred_on(cls, device: torch.device, dtype: torch.dtype | None) -> bool:
        """Whether `auto` takes it, where it runs, on `device` for a `dtype` cache (None: not
        known yet): only where it was measured faster than the reference (`sdpa`)."""
        return False

    def __init__(self, kv_cache: KVCache, layers: Sequence[AttentionSpec]) -> None:
        if len(layers) != len(kv_cache.k):
            raise ValueError(f"{len(layers)} attention layers for a {len(kv_cache.k)}-layer cache")
        self.kv_cache = kv_cache
        self.layers = tuple(layers)

    @abc.abstractmethod
    def build_metadata(self, layout: BatchLayout) -> M:
        """This backend's per-step metadata (masks, index tensors, ...), built once a step."""

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: M) -> None:
        """Store this step's K and V, each (N, nkv, hd), at their slots of layer `layer`."""
        spec, slots = self.layers[layer], meta.layout.slot_mapping
        shape = (-1, spec.num_kv_heads, spec.head_dim)
        self.kv_cache.k[layer].view(shape).index_copy_(0, slots, k)
        self.kv_cache.v[layer].view(shape).index_copy_(0, slots, v)

    @abc.abstractmethod
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: M
    ) -> torch.Tensor:
        """Attention output (N, nh, hd) of every scheduled token of layer `layer`.

        `q` is (N, nh, hd), `k` and `v` (N, nkv, hd): this step's projections (rotary
        applied), already stored by `write_kv`. Each token attends causally to its own
        sequence's context, within the layer's sliding window.
        """

    def warm_up(self) -> None:  # noqa: B027 - optional hook
        """Compile or load whatever the backend needs, before the first request."""
