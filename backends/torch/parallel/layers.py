"""The collectives tensor parallelism adds to the one-device forward, as wrappers.

`RankPlacement(plan)`, handed to the `PagedCausalLM` built over a rank's shard (shard.py),
makes it that rank's part of the tensor-parallel forward, Megatron-style (the model's linears
are built with these collectives in place: linears.py):

- the vocabulary-parallel embedding looks up the rows it holds (zeros elsewhere), then one
  all-reduce gives every rank the full `[N, H]` embeddings;
- attention runs on the rank's own heads (the config's head counts are the local ones, so
  PagedCausalLM sizes attention and its KV cache for them); o_proj is row-parallel: each
  rank's partial `[N, H]` product is summed by an all-reduce;
- gate/up are column-parallel (the rank's intermediate rows), down is row-parallel with an
  all-reduce;
- the LM head computes the rank's vocabulary columns of the logits; rank 0 gathers them
  into `[B, V]` (the sampler runs there only).

That is 2 all-reduces per layer, plus one for the embedding and one gather, per step.

On the generic path (the model's own transformers code, tp_plan.py) the HF modules stay as
they are: `all_reduce_output`, a forward hook on each rowwise module, sums its partial output,
`gather_vocab`, one on a split LM head, gathers its vocabulary parts on rank 0, and
`EmbeddingRows`, a pre-hook and a hook on a split embedding, looks up the ids inside the rank's
rows and sums the parts, as `VocabParallelEmbedding` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backends.torch.layers.linear import Linear
from backends.torch.parallel.sizes import ShardPlan


class RowParallelLinear(Linear):
    """A row-parallel projection: this rank's partial product, all-reduced (summed).

    NOTE: a bias is added on rank 0 only, so the sum holds it once.
    """

    def __init__(self, inner: Linear, rank: int) -> None:  # NOTE: reuses inner's packed weight
        self.adopt(inner, bias=rank == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = super().__call__(x)  # (N, H) partial sum
        dist.all_reduce(out)
        return out


class GatheredLMHead(Linear):
    """The vocabulary-parallel LM head: rank 0 gets the full logits, the others their part."""

    def __init__(self, inner: Linear, rank: int, world_size: int) -> None:
        self.adopt(inner)
        self.rank = rank
        self.world_size = world_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(super().__call__(x), self.rank, self.world_size)


class VocabParallelEmbedding:
    """The vocabulary rows `[start, start + rows)`; the all-reduce brings in the others."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        self.weight = weight  # (V / n, H)
        self.start = start

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local, outside = local_rows(input_ids, self.start, self.weight.shape[0])  # (N,)
        return summed_rows(F.embedding(local, self.weight), outside)  # (N, H)


def local_rows(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ids` as indices into the rows `[start, start + rows)`, 0 for the ids outside them;
    which ids are outside)."""
    local = ids - start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def summed_rows(hidden: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """`hidden` (one row per id) with the rows of the ids `outside` zeroed, summed over the
    ranks in place: each id's row then comes from the one rank that holds it."""
    hidden.masked_fill_(outside[..., None], 0.0)
    dist.all_reduce(hidden)
    return hidden


class EmbeddingRows:
    """Hooks making an HF embedding that holds the vocabulary rows `[start, start + rows)` of
    `vocab_size` vocabulary-parallel: `before` turns the ids into row indices (those outside
    into 0), `after` zeros their rows of the output and sums the ranks' outputs. Exact: each
    id's row comes from one rank, and adding zeros changes no value. An id outside the whole
    vocabulary raises on every rank alike (they see the same ids), before any collective, as
    the whole embedding's lookup would."""

    def __init__(self, embedding: nn.Embedding, start: int, vocab_size: int) -> None:
        self.start, self.rows, self.vocab_size = start, embedding.num_embeddings, vocab_size
        self._outside: torch.Tensor | None = None
        embedding.register_forward_pre_hook(self.before, with_kwargs=True)
        embedding.register_forward_hook(self.after)

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        key = next((k for k in ("input", "input_ids") if k in kwargs), None)
        ids: torch.Tensor = kwargs[key] if key is not None else args[0]
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bool(bad.any()):
            raise IndexError(
                f"token id {int(ids[bad][0])} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        local, self._outside = local_rows(ids, self.start, self.rows)
        if key is not None:
            return args, {**kwargs, key: local}
        return (local, *args[1:]), kwargs

    def after(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        outside, self._outside = self._outside, None
        assert outside is not None, "the embedding ran without its pre-hook"
        return summed_rows(output, outside)


def all_reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the module's partial product summed over the ranks, in place."""
    dist.all_reduce(output)
    return output


def gather_last_dim(local: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every rank's `local` part (its vocabulary columns of the logits) concatenated along
    the last dimension in rank order, on rank 0; the other ranks keep their part (only rank
    0 samples)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(world_size)] if rank == 0 else None
    dist.gather(local, parts, group_dst=0)
    return local if parts is None else torch.cat(parts, dim=-1)


def gather_vocab(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook on a vocabulary-split LM head: its logits gathered on rank 0."""
    return gather_last_dim(output, dist.get_rank(), dist.get_world_size())


class RankPlacement:
    """Rank `plan.rank`'s projections and embedding (linears.py's `Placement`): the
    row-parallel o_proj and down, the gathered LM head, the vocabulary-parallel embedding."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan

    def row_parallel(self, linear: Linear) -> Linear:
        return RowParallelLinear(linear, self.plan.rank)

    def lm_head(self, linear: Linear) -> Linear:
        return GatheredLMHead(linear, self.plan.rank, self.plan.world_size)

    def embedding(self, embed: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = embed.weight
        assert isinstance(weight, torch.Tensor)
        return VocabParallelEmbedding(weight, self.plan.vocab.start)
