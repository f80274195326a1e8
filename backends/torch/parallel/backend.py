"""`TensorParallelBackend`: the torch backend over a tensor-parallel group.

Every rank builds one from its own shard (shard.py): a `TorchBackend` whose HF model has the
local sizes, so its paged forward and its KV cache cover only the rank's own heads, with
the collectives installed (layers.py). Rank 0's is the engine's backend: each step it
flattens the batch (runner.py `prepare`), broadcasts the flat metadata (step.py), runs its
part of the forward with the others, receives the gathered logits and samples; the
scheduler, the block manager and the sampler exist on rank 0 only, and the block ids they
hand out index every rank's cache alike (the ranks agree on the number of blocks at load).

    TensorParallelBackend.load(model="default", *, tensor_parallel_size=2, device=None, ...)

takes the same keyword arguments as `TorchBackend.load`, plus the group size; a size that
cannot split the model is refused before any process starts, naming the valid sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

from backends.torch.attention import AUTO
from backends.torch.kv_cache import KVLayout, kv_budget_bytes, plan_num_blocks
from backends.torch.loader import (
    DEFAULT_MODEL,
    architecture_of,
    check_architecture,
    is_hf_dir,
    resolve_model,
)
from backends.torch.parallel.channel import Channel, Kind
from backends.torch.parallel.group import TensorParallelGroup, acquire_group, release_group
from backends.torch.parallel.layers import parallelize
from backends.torch.parallel.rendezvous import DEFAULT_TIMEOUT_S
from backends.torch.parallel.shard import load_shard
from backends.torch.parallel.sizes import ModelDims, ShardPlan, check_tensor_parallel_size
from backends.torch.parallel.step import FlatStep
from backends.torch.runner import DEFAULT_MAX_NUM_SEQS, TorchBackend, resolve_device, resolve_dtype
from backends.torch.sampler import Sampler
from schedulers.backend import BackendDeadError
from schedulers.batch import Batch


@dataclass(frozen=True)
class LoadSpec:
    """What every rank needs to build its part of one tensor-parallel backend."""

    model_dir: str  # NOTE: a local HF directory; on several nodes, the same path on each
    instance_id: int
    dtype: str | None
    kv_cache_gb: float | None
    kv_cache_fraction: float | None
    block_size: int
    max_model_len: int | None
    max_num_seqs: int
    prepack_weights: bool
    attention_backend: str = AUTO
    cpu_kernels: bool = True


class TensorParallelBackend(TorchBackend):
    """One rank's part of a tensor-parallel torch backend (see the module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        *,
        plan: ShardPlan,
        instance_id: int,
        num_blocks: int,
        device: torch.device,
        spec: LoadSpec,
    ) -> None:
        self.plan = plan
        self.instance_id = instance_id
        self.group: TensorParallelGroup | None = None  # rank 0's, set by `load`
        self._num_blocks = num_blocks
        self._closed = False
        super().__init__(
            model,
            tokenizer,
            device=str(device),
            dtype=spec.dtype,
            kv_cache_gb=spec.kv_cache_gb,
            kv_cache_fraction=spec.kv_cache_fraction,
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            prepack_weights=spec.prepack_weights,
            attention_backend=spec.attention_backend,
            cpu_kernels=spec.cpu_kernels,
        )
        parallelize(self.model, plan)
        # NOTE: the HF config holds the local sizes; the sampler sees the gathered vocabulary
        self.sampler = Sampler(
            plan.dims.vocab_size, self.device, spec.max_num_seqs, cpu_kernels=spec.cpu_kernels
        )

    def _num_kv_blocks(self, layout: KVLayout, budget: int, max_num_seqs: int) -> int:
        return self._num_blocks

    # -- loading (every rank) --------------------------------------------------------

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        tensor_parallel_size: int = 2,
        device: str | None = None,
        dtype: str | None = None,
        kv_cache_gb: float | None = None,
        kv_cache_fraction: float | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        prepack_weights: bool = True,
        attention_backend: str = AUTO,
        compile: bool = False,
        cpu_kernels: bool = True,
        fuse_mlp: bool = True,
        native_layers: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TensorParallelBackend:
        """Start (or join) this process's group and load every rank's shard of `model`.

        NOTE: `compile` is accepted and ignored: the ranks run the eager forward, whose
        row-parallel linears all-reduce (layers.py). So is `fuse_mlp` (an A/B switch of the
        single-process backend): the ranks fuse gate/up where Carousel's kernels run. And
        `native_layers`: a rank's row-parallel linears all-reduce between the kernels, so its
        layers never run as one native call (decode_stack.py).
        """
        source = resolve_model(model)
        if not is_hf_dir(Path(source)):
            source = download(source)
        config = AutoConfig.from_pretrained(source)
        check_architecture(architecture_of(config))
        check_tensor_parallel_size(ModelDims.of(config), tensor_parallel_size)
        tokenizer = AutoTokenizer.from_pretrained(source)
        group = acquire_group(
            tensor_parallel_size, resolve_device(device).type, timeout_s=timeout_s
        )
        try:
            spec = LoadSpec(
                model_dir=source,
                instance_id=group.new_instance_id(),
                dtype=dtype,
                kv_cache_gb=kv_cache_gb,
                kv_cache_fraction=kv_cache_fraction,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                prepack_weights=prepack_weights,
                attention_backend=attention_backend,
                cpu_kernels=cpu_kernels,
            )
            with group.exchange():
                group.send(Kind.LOAD, spec.instance_id)
                group.channel.object(spec)
                backend, errors = cls.build_rank(spec, group.channel, group.device, tokenizer)
            if backend is None:
                raise RuntimeError(f"loading the tensor-parallel shards failed: {errors}")
        except BaseException:
            release_group(group)
            raise
        backend.group = group
        return backend

    @classmethod
    def build_rank(
        cls, spec: LoadSpec, channel: Channel, device: torch.device, tokenizer: Any = None
    ) -> tuple[TensorParallelBackend | None, str]:
        """This rank's backend (None and the ranks' errors if any rank failed).

        Two phases, each ending in one all-gather, so a failure on one rank never leaves the
        others waiting in a collective: the shard and the KV blocks it leaves room for, then
        the cache (the least of the ranks' counts, so block ids mean the same everywhere).
        Before each all-gather the ranks meet in the store (`Channel.meet`): loading may take
        far longer than the collective timeout.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        shard: Any = None
        plan: ShardPlan | None = None
        try:
            plan = ShardPlan(ModelDims.of(AutoConfig.from_pretrained(spec.model_dir)), rank, world)
            dtype = resolve_dtype(spec.dtype, device)
            shard = load_shard(spec.model_dir, plan, dtype, str(device))
            status: tuple[int, str | None] = (_kv_blocks_that_fit(shard, spec, device, dtype), None)
        except Exception as exc:
            status = (0, f"rank {rank}: {exc!r}")
        channel.meet(f"load/{spec.instance_id}/shard")
        statuses = channel.all_gather(status)
        errors = "; ".join(e for _, e in statuses if e)
        if errors:
            return None, errors
        backend: TensorParallelBackend | None = None
        try:
            assert plan is not None
            backend = cls(
                shard,
                tokenizer,
                plan=plan,
                instance_id=spec.instance_id,
                num_blocks=min(n for n, _ in statuses),
                device=device,
                spec=spec,
            )
            failure = None
        except Exception as exc:
            failure = f"rank {rank}: {exc!r}"
        channel.meet(f"load/{spec.instance_id}/cache")
        errors = "; ".join(e for e in channel.all_gather(failure) if e)
        if errors:
            return None, errors
        return backend, ""

    # -- stepping --------------------------------------------------------------------

    def raw_logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """Broadcast the step, run rank 0's part of the forward, return the gathered logits
        (in the model's dtype; `logits` widens them)."""
        group = self._group()
        step = FlatStep.of(self.prepare(batch), rows)
        with group.exchange():
            group.send(Kind.STEP, self.instance_id, step.sizes)
            group.channel.buffer(step.pack())
            return self.run_step(step)

    def run_step(self, step: FlatStep) -> torch.Tensor:
        """This rank's part of one forward (the logits are whole on rank 0 only)."""
        inputs, rows = step.model_input(self.kv_cache.block_size, self.device)
        return self.model(inputs.input_ids, inputs.positions, inputs.layout, rows)

    def describe_rank(self) -> dict[str, int]:
        """This rank's part: its KV cache (block count, own KV heads) and its shard sizes."""
        return {
            "rank": self.plan.rank,
            "num_blocks": self.kv_cache.num_blocks,
            "num_kv_heads": self.kv_cache.layout.num_kv_heads,
            "first_kv_head": self.plan.kv_heads.start,
            "num_heads": len(self.plan.q_heads),
            "vocab_rows": self.model.embed_tokens.weight.shape[0],
        }

    def describe(self) -> list[dict[str, int]]:
        """Every rank's `describe_rank`, in rank order (asks the workers)."""
        group = self._group()
        with group.exchange():
            group.send(Kind.DESCRIBE, self.instance_id)
            return list(group.channel.all_gather(self.describe_rank()))

    def watch(self, on_dead: Callable[[str], None]) -> None:
        self._group().add_listener(on_dead)

    @property
    def dead_reason(self) -> str | None:
        return None if self.group is None else self.group.dead_reason

    def _group(self) -> TensorParallelGroup:
        if self.group is None:
            raise RuntimeError("only rank 0's backend steps the group")
        if self.group.dead_reason is not None:
            raise BackendDeadError(self.group.dead_reason)
        return self.group

    # -- shutdown --------------------------------------------------------------------

    def free(self) -> None:
        """Drop this rank's KV cache (the weights go with the object)."""
        super().close()

    def close(self) -> None:
        """Unload every rank's part; the last backend of the group ends the group."""
        if self._closed or self.group is None:
            return
        self._closed = True
        group = self.group
        with contextlib.suppress(BackendDeadError), group.exchange():
            group.send(Kind.UNLOAD, self.instance_id)
        self.free()
        release_group(group)


def download(repo_id: str) -> str:
    """A hub model's snapshot in the HF cache (each rank then reads its slices from it).

    NOTE: on several nodes every rank needs the same path: a shared cache, or the same
    snapshot downloaded on each node beforehand.
    """
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
    try:
        path = snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as exc:
        raise ValueError(
            f"tensor parallelism reads each rank's shard from an HF directory with safetensors "
            f"weights; {repo_id!r} is not a local one and could not be downloaded ({exc})"
        ) from exc
    if not is_hf_dir(Path(path)):
        raise ValueError(f"{repo_id!r} has no safetensors weights to shard")
    return str(path)


def _kv_blocks_that_fit(
    shard: Any, spec: LoadSpec, device: torch.device, dtype: torch.dtype
) -> int:
    """The KV blocks this rank's budget holds for its own KV heads (as TorchBackend plans)."""
    config = shard.config
    layout = KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=shard.model.layers[0].self_attn.head_dim,
        block_size=spec.block_size,
        dtype=dtype,
    )
    budget = kv_budget_bytes(device, spec.kv_cache_gb, spec.kv_cache_fraction)
    max_model_len = spec.max_model_len or config.max_position_embeddings
    return plan_num_blocks(layout, budget, max_model_len, spec.max_num_seqs)
