"""`RankBackend`: one rank's part of a tensor-parallel model, the same on every rank.

Each rank builds one from its own shard (shard.py): a `TorchBackend` whose HF model has the
local sizes, so its paged forward and its KV cache cover only the rank's own heads, with the
collectives installed (layers.py). The block ids rank 0's scheduler hands out index every
rank's cache alike: the ranks agree on the number of blocks when they build (`build`).

A model on the generic path (`model_impl`, generic/) is cut by its own `base_model_tp_plan`
(tp_plan.py, generic_shard.py) instead of a family's rules, and its rowwise modules get an
all-reduce hook (a split LM head: a gather to rank 0) once the backend is built (the probe
forward of the build runs without them, so no rank ever waits in a collective while another
is still loading).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from backends.torch.config import TRANSFORMERS, TorchBackendConfig
from backends.torch.generic.support import resolve_model_impl
from backends.torch.kv_cache import KVLayout, kv_budget_bytes, plan_num_blocks
from backends.torch.loader import config_dtype
from backends.torch.models import architecture_of
from backends.torch.parallel.channel import Channel
from backends.torch.parallel.generic_shard import load_generic_shard
from backends.torch.parallel.layers import (
    EmbeddingRows,
    RankPlacement,
    all_reduce_output,
    gather_vocab,
)
from backends.torch.parallel.shard import load_shard
from backends.torch.parallel.sizes import ModelDims, ShardPlan
from backends.torch.parallel.step import FlatStep
from backends.torch.parallel.tp_plan import GenericPlan
from backends.torch.runner.backend import TorchBackend, resolve_dtype
from backends.torch.runner.model_impl import ModelBuilder
from schedulers.batch import Batch


@dataclass(frozen=True)
class LoadSpec:
    """What every rank needs to build its part of one model: the whole config, sent as is."""

    model_dir: str  # NOTE: a local HF directory; on several nodes, the same path on each
    instance_id: int
    config: TorchBackendConfig


class RankBackend(TorchBackend):
    """One rank's shard of a tensor-parallel model (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        config: TorchBackendConfig,
        *,
        plan: ShardPlan | GenericPlan,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.plan = plan
        self._num_blocks = num_blocks
        #: one step's forward on every rank; rank 0's backend.py routes it through the workers
        self.forward: Callable[[FlatStep], torch.Tensor] = self.run_step
        # NOTE: the row-parallel linears all-reduce between the kernels, so a rank's layers
        # never run as one native call (config.py refuses native_layers=True)
        own = dataclasses.replace(config, device=str(device), native_layers=False)
        super().__init__(model, tokenizer, own)
        if isinstance(plan, GenericPlan):  # NOTE: after the build's probe forward (module doc)
            for module in plan.rowwise_modules(model):
                module.register_forward_hook(all_reduce_output)
            if plan.split_vocab:
                model.get_output_embeddings().register_forward_hook(gather_vocab)
            if plan.split_embedding:
                embedding = model.get_input_embeddings()
                assert isinstance(embedding, nn.Embedding)  # tp_plan.embedding_splits
                EmbeddingRows(embedding, plan.vocab.start, plan.dims.vocab_size)

    def _placement(self) -> RankPlacement | None:
        return RankPlacement(self.plan) if isinstance(self.plan, ShardPlan) else None

    def _num_kv_blocks(self, layout: KVLayout, budget: int, max_num_seqs: int) -> int:
        return self._num_blocks

    def _vocab_size(self, hf_config: Any) -> int:
        return self.plan.dims.vocab_size  # the HF config holds the local sizes

    @classmethod
    def build(
        cls, spec: LoadSpec, channel: Channel, device: torch.device, tokenizer: Any = None
    ) -> tuple[RankBackend | None, str]:
        """This rank's backend (None and the ranks' errors if any rank failed).

        Two phases, each ending in one all-gather, so a failure on one rank never leaves the
        others waiting in a collective: the shard and the KV blocks it leaves room for, then
        the cache (the least of the ranks' counts, so block ids mean the same everywhere).
        Before each all-gather the ranks meet in the store (`Channel.meet`): loading may take
        far longer than the collective timeout.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        shard: Any = None
        plan: ShardPlan | GenericPlan | None = None
        try:
            hf_config = AutoConfig.from_pretrained(spec.model_dir)
            impl = resolve_model_impl(spec.config.model_impl, architecture_of(hf_config))
            dtype = resolve_dtype(spec.config.dtype, device, config_dtype(hf_config))
            if impl == TRANSFORMERS:
                plan = GenericPlan.of(hf_config, rank, world)
                shard = load_generic_shard(spec.model_dir, plan, dtype, str(device))
            else:
                plan = ShardPlan(ModelDims.of(hf_config), rank, world)
                shard = load_shard(spec.model_dir, plan, dtype, str(device))
            blocks = _kv_blocks_that_fit(shard, impl, spec.config, device, dtype)
            status: tuple[int, str | None] = (blocks, None)
        except Exception as exc:
            status = (0, f"rank {rank}: {exc!r}")
        channel.meet(f"load/{spec.instance_id}/shard")
        statuses = channel.all_gather(status)
        errors = "; ".join(e for _, e in statuses if e)
        if errors:
            return None, errors
        backend: RankBackend | None = None
        try:
            assert plan is not None
            num_blocks = min(n for n, _ in statuses)
            backend = cls(
                shard, tokenizer, spec.config, plan=plan, num_blocks=num_blocks, device=device
            )
            failure = None
        except Exception as exc:
            failure = f"rank {rank}: {exc!r}"
        channel.meet(f"load/{spec.instance_id}/cache")
        errors = "; ".join(e for e in channel.all_gather(failure) if e)
        if errors:
            return None, errors
        return backend, ""

    def raw_logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """The logits of `batch` (whole on rank 0 only), through `forward`."""
        return self.forward(FlatStep.of(self.prepare(batch), rows))

    def run_step(self, step: FlatStep) -> torch.Tensor:
        """This rank's part of one forward (the logits are whole on rank 0 only)."""
        inputs, rows = step.model_input(self.kv_cache.block_size, self.device)
        out: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.layout, rows)
        return out

    def describe_rank(self) -> dict[str, int]:
        """This rank's part: its KV cache (block count, own KV heads) and its shard sizes."""
        return {
            "rank": self.plan.rank,
            "num_blocks": self.kv_cache.num_blocks,
            "num_kv_heads": self.kv_cache.layout.num_kv_heads,
            "first_kv_head": self.plan.kv_heads.start,
            "num_heads": len(self.plan.q_heads),
            "vocab_rows": self._vocab_rows(self.hf_model.get_output_embeddings()),
            "embedding_rows": self._vocab_rows(self.hf_model.get_input_embeddings()),
        }

    def _vocab_rows(self, module: nn.Module) -> int:
        """The vocabulary rows this rank's LM head or embedding `module` holds: read off the
        module on the generic path (it splits only where its plan allows), the plan's on the
        native one."""
        weight = module.weight
        if isinstance(self.plan, GenericPlan) and isinstance(weight, torch.Tensor):
            return int(weight.shape[0])
        return len(self.plan.vocab)

    def free(self) -> None:
        """Drop this rank's KV cache (the weights go with the object)."""
        TorchBackend.close(self)


def _kv_blocks_that_fit(
    shard: Any, impl: str, config: TorchBackendConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """The KV blocks this rank's budget holds for its own KV heads (as TorchBackend plans:
    the layers' specs of path `impl`, the generic path's from a probe of the rank's model)."""
    specs = ModelBuilder.of(shard, impl).specs
    layout = KVLayout(
        num_layers=len(specs),
        num_kv_heads=specs[0].num_kv_heads,
        head_dim=specs[0].head_dim,
        block_size=config.block_size,
        dtype=dtype,
    )
    budget = kv_budget_bytes(device, config.kv_cache_gb, config.kv_cache_fraction)
    max_model_len = config.max_model_len or shard.config.max_position_embeddings
    return plan_num_blocks(layout, budget, max_model_len, config.max_num_seqs)
