"""The torch backend: turns a Batch into flat tensors, runs the paged forward, samples.

Construct it from a model reference::

    TorchBackend.load(config)  # or TorchBackend.load(model="default", device="cpu", ...)

or from an already-built HF causal LM (Llama/Mistral/Qwen2/Qwen3) and its tokenizer::

    TorchBackend(model, tokenizer, config)  # or TorchBackend(model, tokenizer, dtype=...)

Every setting is a field of `TorchBackendConfig` (config.py, which says what each does);
keyword arguments are fields of a config built on the spot. The model is moved and cast in
place. KV sizing: see kv_cache.py.
Compiled kernels are built here, at construction (logged), never on a request's path; or,
with `kernels_in_background` where they are not built yet, in the background while torch's ops
serve, swapped in between two steps (kernel_switch.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.attention import backend_class
from backends.torch.attention.base import AttentionSpec
from backends.torch.config import AUTO, TorchBackendConfig
from backends.torch.kv_cache import (
    KVCache,
    KVGroups,
    KVLayout,
    kv_budget_bytes,
    kv_groups,
    plan_num_blocks,
)
from backends.torch.linears import Placement
from backends.torch.loader import (
    checkpoint_dtype,
    config_dtype,
    load_model,
)
from backends.torch.runner.cuda_graphs import Capturer, DecodeGraphs, cuda_capturer
from backends.torch.runner.device_thread import call_on_own_thread, run_on_device_thread
from backends.torch.runner.inputs import ModelInput
from backends.torch.runner.kernel_switch import KernelSwitch, serves_kernels
from backends.torch.runner.model_impl import ModelBuilder, PagedModel, check_model_impl
from backends.torch.runner.staging import InputStager, StagedInput
from backends.torch.sample.sampler import Sampler
from backends.torch.sample.verify import verify_step
from schedulers.backend import Backend, FastRows, KVCacheSpec
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import blocks_for
from schedulers.load_phase import KERNELS_CAROUSEL, KERNELS_TORCH, WARMING_UP, load_phase


def with_fields(
    config: TorchBackendConfig | str | None, fields: dict[str, Any]
) -> TorchBackendConfig:
    """`config` (default: the defaults; a string: its model) with `fields` replaced."""
    if isinstance(config, str):
        return TorchBackendConfig(model=config, **fields)
    return dataclasses.replace(config or TorchBackendConfig(), **fields)


def resolve_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16), not emulated."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on cuda and on a CPU with native bf16 (docs/benchmarks.md), else fp32."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def auto_dtype(device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """`--dtype auto`: on cuda the checkpoint's dtype where it is a half one (else bf16); on a
    CPU bf16 where it has bf16 products, else fp32 (half types are emulated there, and slow)."""
    if device.type == "cuda" and checkpoint in (torch.bfloat16, torch.float16):
        return checkpoint
    return default_dtype(device)


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, checkpoint: torch.dtype | None = None
) -> torch.dtype:
    """The dtype to run in: `dtype` by name, or (None, `auto`) `auto_dtype` of `checkpoint`."""
    if dtype is None or dtype == "auto":
        return auto_dtype(device, checkpoint)
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'bfloat16', 'float16', 'float32'")
    return resolved


def eos_token_ids_of(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class TorchBackend(Backend):
    """Selective batching over a paged KV cache on one torch device (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        config: TorchBackendConfig | None = None,
        **fields: Any,
    ) -> None:
        with load_phase(WARMING_UP, "allocating the KV cache, packing weights, warming up"):
            self._build(model, tokenizer, with_fields(config, fields))

    def _build(self, model: PreTrainedModel, tokenizer: Any, config: TorchBackendConfig) -> None:
        self.config = config
        device, dtype = config.device, config.dtype
        impl = check_model_impl(model, config)  # refuses before anything is moved or built
        self.device = resolve_device(device)
        # NOTE: on CPU a model handed in without a dtype keeps its own (loaders already chose)
        keep = dtype is None and self.device.type == "cpu"
        checkpoint = config_dtype(model.config)
        self.dtype = model.dtype if keep else resolve_dtype(dtype, self.device, checkpoint)
        # in place, like nn.Module.to; transformers' decorator hides the signature from mypy
        model.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
        self.hf_model = model.eval()
        hf_config = model.config
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or hf_config.max_position_embeddings
        self.eos_token_ids = eos_token_ids_of(model, tokenizer)
        self.builder = ModelBuilder.of(model, impl)  # the generic path probes the model here
        specs = self.builder.specs
        kv_layout = KVLayout(
            num_layers=len(specs),
            num_kv_heads=specs[0].num_kv_heads,
            head_dim=specs[0].head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            groups=self._kv_groups(specs, config),
        )
        budget = kv_budget_bytes(self.device, config.kv_cache_gb, config.kv_cache_fraction)
        num_blocks = self._num_kv_blocks(kv_layout, budget, config.max_num_seqs)  # TP: agreed
        self.kv_cache = KVCache(kv_layout, num_blocks, self.device)
        later = self._kernels_later(config)
        # NOTE: nothing built over torch's ops may ask for the kernels: it would wait for the
        # build's lock (pack plan, attention `auto`, norms and sampler all take `cpu_kernels`)
        served = dataclasses.replace(config, cpu_kernels=False) if later else config
        self.model: PagedModel = self.builder.build(model, self.kv_cache, served, self._placement())
        self.model.attention.warm_up()
        self.sampler = Sampler(
            self._vocab_size(hf_config), self.device, config.max_num_seqs,
            cpu_kernels=served.cpu_kernels,
        )  # fmt: skip
        capture = self._graph_capturer()
        self.stager = InputStager(
            config.block_size, blocks_for(self.max_model_len, config.block_size),
            self.kv_cache.scratch_block, self.device, max_num_seqs=config.max_num_seqs,
            static_device_buffer=True if capture is not None else None,
        )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        if capture is not None:
            self.graphs = DecodeGraphs(
                self.stager, self._forward, self.sampler.vocab_size, config.max_num_seqs, capture
            )
            run_on_device_thread(self.graphs.capture_all)
        self.kernel_switch: KernelSwitch | None = None
        if later:
            self.kernel_switch = self._switch_to_kernels(model, config)
            self.kernel_switch.start()

    def _kernels_later(self, config: TorchBackendConfig) -> bool:
        """Whether to serve on torch's ops now and take the CPU kernels once they are built in
        the background: asked for, on the CPU, one rank, no `compile` or `batch_invariant`
        (they need the kernels from the first step), an attention backend that runs without
        them, and kernels not built yet that can be (else `native()` answers at once)."""
        if not (config.kernels_in_background and config.cpu_kernels):
            return False
        if self.device.type != "cpu" or config.tensor_parallel_size > 1:
            return False
        if config.compile or config.batch_invariant:
            return False
        name = config.attention_backend
        if name != AUTO and backend_class(name).native_decodes:
            return False
        return not kernels.is_built()

    def _switch_to_kernels(
        self, hf_model: PreTrainedModel, config: TorchBackendConfig
    ) -> KernelSwitch:
        """The background build of the kernels and of their model over this backend's HF model
        and KV cache (kernel_switch.py); the sampler stays as built."""

        def build_model() -> PagedModel:
            built = self.builder.build(hf_model, self.kv_cache, config, self._placement())
            built.attention.warm_up()
            return built

        def install(built: PagedModel) -> None:
            self.model = built

        return KernelSwitch(build_model, install)

    @classmethod
    def create(cls, model: PreTrainedModel, tokenizer: Any, **kwargs: Any) -> TorchBackend:
        """`cls(model, tokenizer, **kwargs)` built on a thread of its own that exits (as `load`).

        Building on a long-lived thread (a script's main thread) leaves an OpenMP pool there
        that spins against the device thread's: every later step of every backend in the
        process ran about 1.7x slower after one backend was built on the main thread
        (docs/benchmarks.md).
        """
        return call_on_own_thread(lambda: cls(model, tokenizer, **kwargs), "carousel-build")

    @classmethod
    def load(cls, config: TorchBackendConfig | str | None = None, **fields: Any) -> TorchBackend:
        """Load `config.model` (see loader.py for what a reference may be) onto its device.

        A string is the model reference of a config with the defaults and `fields`.

        The loading runs on a thread of its own that exits afterwards, so it leaves no
        OpenMP pool behind to compete with the engine thread's (runner/device_thread.py).
        """
        config = with_fields(config, fields)
        target = resolve_device(config.device)

        def build() -> TorchBackend:
            auto = config.dtype in (None, "auto") and target.type == "cuda"
            checkpoint = checkpoint_dtype(config.model) if auto else None
            dtype = resolve_dtype(config.dtype, target, checkpoint)
            hf_model, tokenizer = load_model(
                config.model, dtype=dtype, model_impl=config.model_impl
            )
            resolved = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
            return cls(hf_model, tokenizer, resolved)

        return call_on_own_thread(build, "carousel-load")

    def _graph_capturer(self) -> Capturer | None:
        """How decode steps are captured (cuda_graphs.py); None: every step runs eager.

        On CUDA unless `enforce_eager`; never for tensor parallelism, whose ranks meet in
        collectives between the kernels, nor for the generic path, whose transformers code may
        synchronise with the host inside a step.
        """
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager or config.tensor_parallel_size > 1:
            return None
        if self.builder.generic:
            return None
        return cuda_capturer(self.device)

    def _kv_groups(
        self, specs: Sequence[AttentionSpec], config: TorchBackendConfig
    ) -> KVGroups | None:
        """The KV cache groups of a model on the generic path whose sliding layers may keep
        only their window's blocks (kv_cache.py; None: one group). One device only: tensor
        parallelism's ranks rebuild each step's layout from the broadcast main tables."""
        if not self.builder.generic or config.tensor_parallel_size > 1:
            return None
        if config.disable_hybrid_kv_cache_manager:
            return None
        return kv_groups([spec.sliding_window for spec in specs])

    def _placement(self) -> Placement | None:
        """Tensor parallelism's placement of this rank's projections (parallel/rank.py);
        None: the whole model on one device."""
        return None

    def _num_kv_blocks(self, layout: KVLayout, budget: int, max_num_seqs: int) -> int:
        """KV blocks to allocate (tensor parallelism overrides it with the ranks' agreed count)."""
        return plan_num_blocks(layout, budget, self.max_model_len, max_num_seqs)

    def _vocab_size(self, hf_config: Any) -> int:
        """The sampler's vocabulary (tensor parallelism: the gathered one, not the shard's)."""
        return int(hf_config.vocab_size)

    @property
    def grammar_vocab_size(self) -> int:
        return self.sampler.vocab_size

    @property
    def generation_config(self) -> dict[str, Any]:
        config = getattr(self.hf_model, "generation_config", None)
        return {} if config is None else dict(config.to_diff_dict())

    @property
    def weight_bytes(self) -> dict[str, int]:
        return dict(self.model.quantization.weight_bytes)

    @property
    def fast_rows(self) -> FastRows | None:
        """The quantised linears' `R` and their measured speedup there, where they serve."""
        report = self.model.quantization
        if report.layer_max_rows < 1:
            return None
        return FastRows(report.layer_max_rows, report.layer_speedup)

    @property
    def serving_kernels(self) -> str | None:
        """Which ops serve: `carousel` (its CPU kernels), `building` (torch's while they build
        in the background) or `torch`; None off the CPU, where they do not apply."""
        if self.kernel_switch is not None:
            return self.kernel_switch.state
        if self.device.type != "cpu":
            return None
        return KERNELS_CAROUSEL if serves_kernels(self.model) else KERNELS_TORCH

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        cache = self.kv_cache
        groups = cache.layout.groups
        windows = () if groups is None else groups.sliding_windows
        return KVCacheSpec(
            cache.num_blocks, cache.block_size, cache.layout.bytes_per_block, windows
        )

    def execute(self, batch: Batch) -> ExecuteOutput:
        """Run `batch` on the process's one device thread (runner/device_thread.py)."""
        return run_on_device_thread(self._execute, batch)

    def _execute(self, batch: Batch) -> ExecuteOutput:
        if batch.num_draft_tokens:
            return self._verify(batch)
        rows = [i for i in range(len(batch.seqs)) if batch.samples_after(i)]
        seqs = [batch.seqs[i] for i in rows]
        replayed = self.graphs.run(batch) if self.graphs is not None else None
        if replayed is None:
            logits = self.raw_logits(batch, rows)  # the sampler widens them where it must
            greedy = None
        else:
            logits, greedy = replayed  # the real rows only: padding never reaches the sampler
            if len(rows) < len(batch.seqs):
                index = torch.tensor(rows, dtype=torch.long, device=self.device)
                logits, greedy = logits[index], greedy[index]
        if not seqs:
            return ExecuteOutput()
        sampled = self.sampler(logits, seqs, greedy_ids=greedy)
        return ExecuteOutput(
            sampled={seq.seq_id: tok for seq, tok in zip(seqs, sampled, strict=True)}
        )

    def _verify(self, batch: Batch) -> ExecuteOutput:
        """A step that verifies drafts: logits at every position of its sampled rows (staged
        as runner/verify_rows.py lays them out; never a CUDA graph's), then each row's tokens
        (sample/verify.py)."""
        rows = [i for i in range(len(batch.seqs)) if batch.samples_after(i)]
        return verify_step(self.sampler, self.raw_logits(batch, rows), batch, rows)

    @property
    def verifies_drafts(self) -> bool:
        return True

    def logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """Run `batch` (writing its KV) and return float32 logits (B', V) at the last scheduled
        token of `batch.seqs[rows]` (every sequence when `rows` is None)."""
        return self.raw_logits(batch, rows).float()

    def raw_logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """`logits` in the model's dtype."""
        staged = self.stage(batch, rows)
        return self._forward(staged.model_input, staged.logits_indices)

    def _forward(
        self, inputs: ModelInput, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's logits for staged `inputs` (what a CUDA graph captures, all rows)."""
        out: torch.Tensor = self.model(
            inputs.input_ids, inputs.positions, inputs.layout, logits_indices
        )
        return out

    def stage(self, batch: Batch, rows: list[int] | None = None) -> StagedInput:
        """`batch`'s inputs in the persistent buffers, on the device in one copy (staging.py)."""
        return self.stager.stage(batch, rows)

    def prepare(self, batch: Batch) -> ModelInput:
        """Flatten `batch` into token ids, positions and attention layout on the device."""
        return self.stage(batch).model_input

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)
        self.stager.release(seq_id)

    def close(self) -> None:
        if self.kernel_switch is not None:
            self.kernel_switch.close()
        self.model.close()  # its native stack holds every layer's K/V tensors too
        self.kv_cache.k.clear()
        self.kv_cache.v.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
