"""Which tensor-parallel sizes a model allows, and what one rank holds of it.

A size N is valid when it divides the attention heads, the intermediate size and the
vocabulary, and either divides the KV heads or is a multiple of them (then each KV head is
replicated on N / num_kv_heads ranks, as vLLM does). The hidden size is never split: norms,
rotary and the residual stream are replicated on every rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder-only model that tensor parallelism splits."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any) -> ModelDims:
        head_dim = getattr(config, "head_dim", None)
        return cls(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim or config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
        )

    def problems(self, size: int) -> list[str]:
        """Why `size` ranks cannot split this model (empty when they can)."""
        found = []
        if size < 1:
            found.append("it must be at least 1")
        else:
            for name, value in (
                ("attention heads", self.num_heads),
                ("intermediate size", self.intermediate_size),
                ("vocabulary", self.vocab_size),
            ):
                if value % size:
                    found.append(f"it does not divide the {value} {name}")
            kv = self.num_kv_heads
            if kv % size and size % kv:
                found.append(f"it neither divides nor is a multiple of the {kv} KV heads")
        return found

    def valid_sizes(self) -> list[int]:
        return [n for n in range(1, self.num_heads + 1) if not self.problems(n)]


def check_tensor_parallel_size(dims: ModelDims, size: int) -> None:
    """Raise ValueError naming the valid sizes unless `size` ranks can split the model."""
    problems = dims.problems(size)
    if problems:
        valid = ", ".join(map(str, dims.valid_sizes()))
        raise ValueError(
            f"tensor_parallel_size {size} cannot split this model: {'; '.join(problems)} "
            f"(heads {dims.num_heads}, KV heads {dims.num_kv_heads}, intermediate "
            f"{dims.intermediate_size}, vocabulary {dims.vocab_size}); valid sizes: {valid}"
        )


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world_size` holds: a contiguous range of each split dimension."""

    dims: ModelDims
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.dims, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    def _part(self, total: int) -> range:
        size = total // self.world_size
        return range(self.rank * size, (self.rank + 1) * size)

    @property
    def q_heads(self) -> range:
        return self._part(self.dims.num_heads)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads; one replicated head when there are more ranks than heads.

        NOTE: query head h reads KV head h // (num_heads / num_kv_heads) (GQA); with
        replication every local query head maps to the same KV head, the one returned here.
        """
        kv, n = self.dims.num_kv_heads, self.world_size
        if kv >= n:
            return self._part(kv)
        head = self.rank // (n // kv)
        return range(head, head + 1)

    @property
    def intermediate(self) -> range:
        return self._part(self.dims.intermediate_size)

    @property
    def vocab(self) -> range:
        return self._part(self.dims.vocab_size)

    def local_config(self, config: Any) -> Any:
        """A copy of `config` sized for this rank: local heads, KV heads, MLP and vocabulary.

        NOTE: head_dim is pinned to the global one first (Llama derives it from hidden_size /
        num_attention_heads, which would change with the local head count).
        """
        local = copy.deepcopy(config)
        local.head_dim = self.dims.head_dim
        local.num_attention_heads = len(self.q_heads)
        local.num_key_value_heads = len(self.kv_heads)
        local.intermediate_size = len(self.intermediate)
        local.vocab_size = len(self.vocab)
        return local
