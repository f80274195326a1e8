"""`TensorParallelBackend`: the engine's backend over a tensor-parallel group (rank 0).

Every rank's worker (worker.py) builds its part of the model (rank.py, `RankBackend`);
this wraps rank 0's. Each step rank 0 flattens the batch (runner.py `prepare`), and its
worker `call`s the step on every rank (step.py carries the flat metadata), runs its own
part of the forward with the others, receives the gathered logits and samples; the
scheduler, the block manager and the sampler exist on rank 0 only.

    TensorParallelBackend.load(config)  # or .load("default", tensor_parallel_size=2, ...)

takes the `TorchBackendConfig` (or its fields) `TorchBackend.load` takes, whole: each rank
receives it as is. A size that cannot split the model is refused before any process
starts, naming the valid sizes (on the generic path, `model_impl`: naming why the model's
`base_model_tp_plan` cannot cut it, tp_plan.py); a setting the ranks cannot honour is refused
by the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from backends.torch.config import TRANSFORMERS, TorchBackendConfig
from backends.torch.generic.support import check_model
from backends.torch.loader import is_hf_dir, resolve_model
from backends.torch.models import architecture_of
from backends.torch.parallel.channel import Kind
from backends.torch.parallel.group import TensorParallelGroup, acquire_group, release_group
from backends.torch.parallel.rank import LoadSpec, RankBackend
from backends.torch.parallel.rendezvous import DEFAULT_TIMEOUT_S
from backends.torch.parallel.sizes import ModelDims, check_tensor_parallel_size
from backends.torch.parallel.step import FlatStep
from backends.torch.parallel.tp_plan import choose_split
from backends.torch.runner.backend import resolve_device, with_fields
from schedulers.backend import Backend, BackendDeadError, KVCacheSpec
from schedulers.batch import Batch, ExecuteOutput


class TensorParallelBackend(Backend):
    """Rank 0's part of a tensor-parallel torch backend (see the module docstring)."""

    def __init__(self, shard: RankBackend, group: TensorParallelGroup, instance_id: int) -> None:
        self.shard = shard
        self.group = group
        self.instance_id = instance_id
        self.config = shard.config
        self.tokenizer = shard.tokenizer
        self.eos_token_ids = shard.eos_token_ids
        self.max_model_len = shard.max_model_len
        self.device = shard.device
        self.dtype = shard.dtype
        self._closed = False
        shard.forward = self._step_every_rank

    @classmethod
    def load(
        cls,
        config: TorchBackendConfig | str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **fields: Any,
    ) -> TensorParallelBackend:
        """Start (or join) this process's group and load every rank's shard of the model."""
        config = with_fields(config, fields)
        source = resolve_model(config.model)
        if not is_hf_dir(Path(source)):
            source = download(source)
        hf_config = AutoConfig.from_pretrained(source)
        if check_model(hf_config, architecture_of(hf_config), config.model_impl) == TRANSFORMERS:
            config.check_generic()
            choose_split(hf_config, config.tensor_parallel_size)  # the model's own TP plan
        else:
            check_tensor_parallel_size(ModelDims.of(hf_config), config.tensor_parallel_size)
        tokenizer = AutoTokenizer.from_pretrained(source)
        device_type = resolve_device(config.device).type
        group = acquire_group(config.tensor_parallel_size, device_type, timeout_s=timeout_s)
        try:
            spec = LoadSpec(model_dir=source, instance_id=group.new_instance_id(), config=config)
            shard, errors = group.call(Kind.LOAD, spec.instance_id, spec, tokenizer)
            if shard is None:
                raise RuntimeError(f"loading the tensor-parallel shards failed: {errors}")
        except BaseException:
            release_group(group)
            raise
        return cls(shard, group, spec.instance_id)

    # -- stepping --------------------------------------------------------------------

    @property
    def grammar_vocab_size(self) -> int:
        return self.shard.grammar_vocab_size

    @property
    def generation_config(self) -> dict[str, Any]:
        return self.shard.generation_config

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.shard.kv_cache_spec

    def execute(self, batch: Batch) -> ExecuteOutput:
        return self.shard.execute(batch)

    def logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """Float32 logits of `batch` (see `TorchBackend.logits`), gathered from every rank."""
        return self.shard.logits(batch, rows)

    def prepare(self, batch: Batch) -> Any:
        return self.shard.prepare(batch)

    def release(self, seq_id: int) -> None:
        self.shard.release(seq_id)

    def _step_every_rank(self, step: FlatStep) -> torch.Tensor:
        """Every rank's part of one forward; the gathered logits (in the model's dtype)."""
        logits: torch.Tensor = self._group().call(Kind.STEP, self.instance_id, step)
        return logits

    def describe(self) -> list[dict[str, int]]:
        """Every rank's `describe_rank`, in rank order (asks the workers)."""
        ranks: list[dict[str, int]] = self._group().call(Kind.DESCRIBE, self.instance_id)
        return ranks

    def watch(self, on_dead: Callable[[str], None]) -> None:
        self.group.add_listener(on_dead)

    @property
    def dead_reason(self) -> str | None:
        return self.group.dead_reason

    def _group(self) -> TensorParallelGroup:
        if self.group.dead_reason is not None:
            raise BackendDeadError(self.group.dead_reason)
        return self.group

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Unload every rank's part; the last backend of the group ends the group."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(BackendDeadError):
            self.group.call(Kind.UNLOAD, self.instance_id)
        self.shard.free()
        release_group(self.group)


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
