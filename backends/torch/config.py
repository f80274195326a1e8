"""`TorchBackendConfig`: every setting of the torch backend, built once and handed down whole.

The gateway builds it from the settings (gateway/engine_factory.py); `TorchBackend`
(runner.py), the paged model (model.py) and the tensor-parallel backend and its ranks
(parallel/) read their settings from it, so a setting is named in one place. Frozen and
picklable: the tensor-parallel ranks receive it whole.

`model`: what loader.py resolves (`default`, an HF directory, a `.gguf` file, a hub id).
`device`: cuda when available, else cpu (None). `dtype`: "bfloat16", "float32", ... (None:
bf16 on cuda and on a CPU with AMX or AVX512-BF16, else fp32; a model handed in on CPU keeps
its own). `kv_cache_gb` / `kv_cache_fraction`: the KV budget (kv_cache.py). `max_num_seqs`:
the most sequences of one step, the scheduler's default (schedulers/defaults.py): the KV
cache never holds more than that many full contexts, and the step buffers are sized for it.
`prepack_weights`: on CPU, few-row matmuls go through prepacked weights (layers/linear.py).
`disable_hybrid_kv_cache_manager` (vLLM's name): one KV cache group even for a model whose
sliding-window layers could keep only their window's blocks (kv_cache.py's `KVGroups`).
`attention_backend`: a name from attention/ (`auto` is `cpu_paged` where Carousel's CPU kernels
run, else `sdpa`). `cpu_kernels`: Carousel's AVX-512 kernels (cpu_kernels/) where they build.
`kernels_in_background`: where those kernels are not built yet, serve at once on torch's ops
while they build at the lowest priority, then take them between two steps
(runner/kernel_switch.py); False (the default of a backend built in code, so tests and scripts
get the kernels before the first step) builds them first. `fuse_mlp`: with those kernels, a
SiLU MLP's gate, up and activation as one kernel. `native_layers`: with those kernels, a
decode-only step runs every layer in one native call (stacks/native.py); None runs it where it
can, True also refuses a backend that never can (tensor parallelism), False keeps the Python
loop (A/B runs). `compile`: the dense part of every layer through one torch.compile'd graph
(stacks/compiled_layer.py).
`enforce_eager`: on CUDA, no CUDA graphs (cuda_graphs.py; vLLM's flag): every step runs eager.
`tensor_parallel_size`: split the model over this many ranks (parallel/).
`quantization` (vLLM's spelling): `auto`, `gguf`, `int8`, `none`; weight-only quantised
copies of the linears for small steps (quantization/); `quantization_max_rows`: the most
rows a step may have to take them (None: measured at load).
`batch_invariant` (vLLM's `VLLM_BATCH_INVARIANT`): a sequence's logits never depend on what else
is in its step: every linear takes Carousel's packed kernel at any row count (no int4 / bf16
or packed / `F.linear` switch by the step's rows), and attention computes each token as a
decode over its own context (no prefill / decode or chunking split); CPU with Carousel's
kernels only, `quantization` `auto` serving `none` (docs/batch-invariance.md).
`model_impl` (vLLM's `--model-impl`): `carousel`, the native path of the families in models/;
`transformers`, the generic path (generic/): the model's own transformers code over the paged
KV cache, only attention going to the attention backends; `auto`, native where a family
implements the class, else generic. The generic path runs no compiled layer, native stack,
quantised linears or batch invariance, and refuses them by name; its tensor parallelism cuts
the model by the config's own `base_model_tp_plan` (parallel/tp_plan.py, which refuses, at
load, a model whose plan cannot split it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schedulers import defaults

DEFAULT_MODEL = "default"
AUTO = "auto"
QUANTIZATIONS = (AUTO, "gguf", "int8", "none")
QUANTIZED = ("gguf", "int8")  # what `auto` never forces on a backend that cannot run it
CAROUSEL = "carousel"
TRANSFORMERS = "transformers"
MODEL_IMPLS = (AUTO, CAROUSEL, TRANSFORMERS)


@dataclass(frozen=True)
class TorchBackendConfig:
    """The torch backend's settings (see the module docstring)."""

    model: str = DEFAULT_MODEL
    device: str | None = None
    dtype: str | None = None
    kv_cache_gb: float | None = None
    kv_cache_fraction: float | None = None
    block_size: int = defaults.BLOCK_SIZE
    max_model_len: int | None = None
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    prepack_weights: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    attention_backend: str = AUTO
    cpu_kernels: bool = True
    kernels_in_background: bool = False
    fuse_mlp: bool = True
    native_layers: bool | None = None
    compile: bool = False
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    quantization: str = AUTO
    quantization_max_rows: int | None = None
    batch_invariant: bool = False
    model_impl: str = AUTO

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(
                f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}"
            )
        values = dataclasses.asdict(self)
        if self.model_impl == TRANSFORMERS:
            self.check_generic()
        if self.compile and self.quantization in QUANTIZED:
            raise ValueError(
                f"compile cannot honour quantization {self.quantization!r}: the compiled layer "
                "calls the full-precision linears; drop one of them"
            )
        conflicts = _batch_invariance_conflicts(values)
        if self.batch_invariant and conflicts:
            raise ValueError(
                f"batch_invariant cannot be honoured with {', '.join(conflicts)}: those paths "
                "choose their kernels by the step's rows (docs/batch-invariance.md); drop one"
            )
        unhonoured = _refused_by_tensor_parallel(values)
        if self.tensor_parallel_size > 1 and unhonoured:
            raise ValueError(
                f"tensor parallelism cannot honour {', '.join(unhonoured)}: its ranks run the "
                "eager forward, whose row-parallel linears all-reduce between the kernels "
                "(docs/parallelism.md); drop it or use tensor_parallel_size 1"
            )

    @classmethod
    def unhonoured(cls, values: Mapping[str, Any]) -> list[str]:
        """The settings among `values` (field name -> value; the fields not named at their
        defaults) this backend cannot honour together: what building the config refuses,
        asked without building one. The gateway refuses them at start-up, by name, from
        here (this module imports no torch)."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        given = {**fields, **{k: v for k, v in values.items() if k in fields}}
        parallel = given["tensor_parallel_size"] > 1
        names = [n for n in ("compile", "native_layers") if parallel and given[n]]
        if given["batch_invariant"] and _batch_invariance_conflicts(given):
            names.append("batch_invariant")
        if given["quantization"] in QUANTIZED and (parallel or given["compile"]):
            names.append("quantization")
        if given["model_impl"] == TRANSFORMERS:
            names += [n for n in _refused_by_generic(given) if n not in names]
        return names

    @property
    def honours_quantization(self) -> bool:
        """Whether quantised linears may run with the rest of this config (no tensor
        parallelism, compile or batch invariance): `auto` serves a GGUF's own blocks only
        then (quantization.resolve_mode)."""
        return not self.unhonoured({**dataclasses.asdict(self), "quantization": QUANTIZED[-1]})

    def check_generic(self) -> None:
        """Raise ValueError naming the settings the generic (transformers) path cannot honour:
        asked of `model_impl` `transformers`, and of `auto` once it chose that path."""
        refused = _refused_by_generic(dataclasses.asdict(self))
        if refused:
            raise ValueError(
                f"the generic (transformers) model path cannot honour {', '.join(refused)}: it "
                "runs the model's own transformers code, with only attention on Carousel's "
                "backends; drop them or use model_impl carousel (for the families in models/)"
            )

    def unsupported_by_tensor_parallel(self) -> list[str]:
        """The settings given here that a tensor-parallel rank cannot honour."""
        return _refused_by_tensor_parallel(dataclasses.asdict(self))

    def conflicts_with_batch_invariance(self) -> list[str]:
        """The settings given here that `batch_invariant` cannot run with."""
        return _batch_invariance_conflicts(dataclasses.asdict(self))


def _refused_by_tensor_parallel(values: Mapping[str, Any]) -> list[str]:
    """What a tensor-parallel rank cannot run: the compiled layer, the native stack and
    quantised linears (its row-parallel linears all-reduce between the kernels)."""
    names = [n for n in ("compile", "native_layers") if values[n]]
    return [*names, "quantization"] if values["quantization"] in QUANTIZED else names


def _refused_by_generic(values: Mapping[str, Any]) -> list[str]:
    """What the generic path cannot run: the compiled layer, the native stack (asked for by
    True), quantised linears and batch invariance (tensor parallelism runs: whether a model's
    plan can split it is asked at load, parallel/tp_plan.py)."""
    named = {
        "compile": values["compile"],
        "native_layers": values["native_layers"] is True,
        "quantization": values["quantization"] in QUANTIZED,
        "batch_invariant": values["batch_invariant"],
    }
    return [name for name, refused in named.items() if refused]


def _batch_invariance_conflicts(values: Mapping[str, Any]) -> list[str]:
    """The settings that choose a kernel by the step's rows, or leave Carousel's CPU kernels
    out: what `batch_invariant` cannot run with."""
    named = {
        "quantization": values["quantization"] in QUANTIZED,
        "compile": values["compile"],
        "tensor_parallel_size": values["tensor_parallel_size"] > 1,
        "cpu_kernels": not values["cpu_kernels"],
        "prepack_weights": not values["prepack_weights"],
        "attention_backend": values["attention_backend"] not in (AUTO, "cpu_paged"),
    }
    return [name for name, conflicts in named.items() if conflicts]
