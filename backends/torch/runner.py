"""The torch backend: turns a Batch into flat tensors, runs the paged forward, samples.

Construct it either from a model reference::

    TorchBackend.load(model="default", *, device=None, dtype=None, kv_cache_gb=None,
                      kv_cache_fraction=None, block_size=16, max_model_len=None,
                      max_num_seqs=256, prepack_weights=True, attention_backend="auto",
                      compile=False, cpu_kernels=True, fuse_mlp=True,
                      native_layers=True)

or from an already-built HF causal LM (Llama/Mistral/Qwen2/Qwen3) and its tokenizer::

    TorchBackend(model, tokenizer, *, device=None, dtype=None, kv_cache_gb=None,
                 kv_cache_fraction=None, block_size=16, max_model_len=None, max_num_seqs=256,
                 prepack_weights=True, attention_backend="auto", compile=False,
                 cpu_kernels=True, fuse_mlp=True, native_layers=True)

`device` defaults to cuda when available, else cpu; `dtype` ("bfloat16", "float32", ...) to
bf16 on cuda and on a CPU with AMX or AVX512-BF16, else fp32 (`default_dtype`); a model handed
in on CPU without a dtype keeps its own. The model is moved and cast in place. KV sizing: see
kv_cache.py (`max_num_seqs` only caps the KV cache: it never holds more than that many full
contexts).
`prepack_weights`: on CPU, matmuls with few rows go through prepacked weights (an extra copy
of the weights; see packed.py); False keeps one copy and plain `F.linear`.
`attention_backend`: a name from backends/torch/attention/ (`auto`, `sdpa`, `inductor_paged`,
`cpu_paged`); `auto` is `cpu_paged` where Carousel's CPU kernels run, else `sdpa` (see
attention/__init__.py). `cpu_kernels`: on CPU, Carousel's own AVX-512 kernels (cpu_kernels/)
for the prepacked matmuls and `auto`'s attention, where they build; False keeps torch's.
`fuse_mlp`: with those kernels, a SiLU MLP's gate, up and activation run as one kernel
(packed.GateUp); False keeps three calls (for A/B runs: scripts/step_ab.py).
`native_layers`: with those kernels, a decode-only step runs every decoder layer in one native
call (decode_stack.py), bit for bit the eager loop's; False keeps the loop in Python (A/B).
`compile`: the dense part of every decoder layer runs through one torch.compile'd graph
(dense.py; eager without a C++ compiler).
Compiled kernels are built here, at construction (logged), never on a request's path.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from backends.torch.attention import AUTO
from backends.torch.device_thread import call_on_own_thread, run_on_device_thread
from backends.torch.inputs import ModelInput, prepare_inputs
from backends.torch.kv_cache import KVCache, KVLayout, kv_budget_bytes, plan_num_blocks
from backends.torch.loader import DEFAULT_MODEL, check_architecture, load_model
from backends.torch.model import PagedCausalLM, attention_specs
from backends.torch.sampler import Sampler
from schedulers.backend import Backend, KVCacheSpec
from schedulers.batch import Batch, ExecuteOutput

DEFAULT_MAX_NUM_SEQS = 256


def resolve_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16), not emulated."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on cuda and on a CPU with native bf16 (docs/benchmarks.md, issue 15), else fp32."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return default_dtype(device)
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
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
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
    ) -> None:
        check_architecture(type(model).__name__)
        self.device = resolve_device(device)
        # NOTE: on CPU a model handed in without a dtype keeps its own (loaders already chose)
        keep = dtype is None and self.device.type == "cpu"
        self.dtype = model.dtype if keep else resolve_dtype(dtype, self.device)
        # in place, like nn.Module.to; transformers' decorator hides the signature from mypy
        model.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
        self.hf_model = model.eval()
        config = model.config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.eos_token_ids = eos_token_ids_of(model, tokenizer)
        specs = attention_specs(model)
        kv_layout = KVLayout(
            num_layers=len(specs),
            num_kv_heads=specs[0].num_kv_heads,
            head_dim=specs[0].head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )
        budget = kv_budget_bytes(self.device, kv_cache_gb, kv_cache_fraction)
        num_blocks = self._num_kv_blocks(kv_layout, budget, max_num_seqs)  # TP: the ranks agree
        self.kv_cache = KVCache(kv_layout, num_blocks, self.device)
        self.model = PagedCausalLM(
            model,
            self.kv_cache,
            prepack=prepack_weights,
            attention_backend=attention_backend,
            cpu_kernels=cpu_kernels,
            fuse_mlp=fuse_mlp,
            native_layers=native_layers,
        )
        self.model.attention.warm_up()
        if compile and self.model.compilable():
            self.model.enable_compiled()
        self.sampler = Sampler(
            config.vocab_size, self.device, max_num_seqs, cpu_kernels=cpu_kernels
        )

    @classmethod
    def create(cls, model: PreTrainedModel, tokenizer: Any, **kwargs: Any) -> TorchBackend:
        """`cls(model, tokenizer, **kwargs)` built on a thread of its own that exits (as `load`).

        Building on a long-lived thread (a script's main thread) leaves an OpenMP pool there
        that spins against the device thread's: every later step of every backend in the
        process ran about 1.7x slower after one backend was built on the main thread
        (docs/benchmarks.md, issue 15).
        """
        return call_on_own_thread(lambda: cls(model, tokenizer, **kwargs), "carousel-build")

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        *,
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
    ) -> TorchBackend:
        """Load `model` (see loader.py for what a reference may be) onto `device`.

        The loading runs on a thread of its own that exits afterwards, so it leaves no
        OpenMP pool behind to compete with the engine thread's (backends/torch/device_thread.py).
        """
        target = resolve_device(device)

        def build() -> TorchBackend:
            hf_model, tokenizer = load_model(model, dtype=resolve_dtype(dtype, target))
            return cls(
                hf_model,
                tokenizer,
                device=device,
                dtype=dtype,
                kv_cache_gb=kv_cache_gb,
                kv_cache_fraction=kv_cache_fraction,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                prepack_weights=prepack_weights,
                attention_backend=attention_backend,
                compile=compile,
                cpu_kernels=cpu_kernels,
                fuse_mlp=fuse_mlp,
                native_layers=native_layers,
            )

        return call_on_own_thread(build, "carousel-load")

    def _num_kv_blocks(self, layout: KVLayout, budget: int, max_num_seqs: int) -> int:
        """KV blocks to allocate (tensor parallelism overrides it with the ranks' agreed count)."""
        return plan_num_blocks(layout, budget, self.max_model_len, max_num_seqs)

    @property
    def grammar_vocab_size(self) -> int:
        return self.sampler.vocab_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_blocks=self.kv_cache.num_blocks, block_size=self.kv_cache.block_size)

    def execute(self, batch: Batch) -> ExecuteOutput:
        """Run `batch` on the process's one device thread (backends/torch/device_thread.py)."""
        return run_on_device_thread(self._execute, batch)

    def _execute(self, batch: Batch) -> ExecuteOutput:
        rows = [i for i in range(len(batch.seqs)) if batch.samples_after(i)]
        logits = self.raw_logits(batch, rows)  # the sampler widens them where it must
        seqs = [batch.seqs[i] for i in rows]
        if not seqs:
            return ExecuteOutput()
        sampled = self.sampler(logits, seqs)
        return ExecuteOutput(
            sampled={seq.seq_id: tok for seq, tok in zip(seqs, sampled, strict=True)}
        )

    def logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """Run `batch` (writing its KV) and return float32 logits (B', V) at the last scheduled
        token of `batch.seqs[rows]` (every sequence when `rows` is None)."""
        return self.raw_logits(batch, rows).float()

    def raw_logits(self, batch: Batch, rows: list[int] | None = None) -> torch.Tensor:
        """`logits` in the model's dtype."""
        inputs = self.prepare(batch)
        indices = None if rows is None else torch.tensor(rows, dtype=torch.long, device=self.device)
        out: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.layout, indices)
        return out

    def prepare(self, batch: Batch) -> ModelInput:
        """Flatten `batch` into token ids, positions and attention layout on the device."""
        return prepare_inputs(batch, self.kv_cache.block_size, self.device)

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)

    def close(self) -> None:
        self.model.native_layers = None  # it holds every layer's K/V tensors too
        self.kv_cache.k.clear()
        self.kv_cache.v.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
