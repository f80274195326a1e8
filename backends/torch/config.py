"""`TorchBackendConfig`: every setting of the torch backend, built once and handed down whole.

The gateway builds it from the settings (gateway/engine_factory.py); `TorchBackend`
(runner.py), the paged model (model.py) and the tensor-parallel backend and its ranks
(parallel/) read their settings from it, so a setting is named in one place. Frozen and
picklable: the tensor-parallel ranks receive it whole.

`model`: what loader.py resolves (`default`, an HF directory, a `.gguf` file, a hub id).
`device`: cuda when available, else cpu (None). `dtype`: "bfloat16", "float32", ... (None:
bf16 on cuda and on a CPU with AMX or AVX512-BF16, else fp32; a model handed in on CPU keeps
its own). `kv_cache_gb` / `kv_cache_fraction`: the KV budget (kv_cache.py). `max_num_seqs`
only caps the KV cache (it never holds more than that many full contexts).
`prepack_weights`: on CPU, few-row matmuls go through prepacked weights (packed.py).
`attention_backend`: a name from attention/ (`auto` is `cpu_paged` where Carousel's CPU
kernels run, else `sdpa`). `cpu_kernels`: Carousel's AVX-512 kernels (cpu_kernels/) where
they build. `fuse_mlp`: with those kernels, a SiLU MLP's gate, up and activation as one
kernel. `native_layers`: with those kernels, a decode-only step runs every layer in one
native call (decode_stack.py); None runs it where it can, True also refuses a backend that
never can (tensor parallelism), False keeps the Python loop (A/B runs). `compile`: the dense
part of every layer through one torch.compile'd graph (dense.py). `enforce_eager`: on CUDA,
no CUDA graphs (cuda_graphs.py; vLLM's flag): every step runs eager.
`tensor_parallel_size`: split the model over this many ranks (parallel/).
`quantization` (vLLM's spelling): `auto`, `gguf`, `int8`, `none`; weight-only quantised
copies of the linears for small steps (quantization.py); `quantization_max_rows`: the most
rows a step may have to take them (None: measured at load).
`batch_invariant` (vLLM's `VLLM_BATCH_INVARIANT`): a sequence's logits never depend on what else
is in its step: every linear takes Carousel's packed kernel at any row count (no int4 / bf16
or packed / `F.linear` switch by the step's rows), and attention computes each token as a
decode over its own context (no prefill / decode or chunking split); CPU with Carousel's
kernels only, `quantization` `auto` serving `none` (docs/batch-invariance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "default"
DEFAULT_MAX_NUM_SEQS = 256
AUTO = "auto"
QUANTIZATIONS = (AUTO, "gguf", "int8", "none")
QUANTIZED = ("gguf", "int8")  # what `auto` never forces on a backend that cannot run it


@dataclass(frozen=True)
class TorchBackendConfig:
    """The torch backend's settings (see the module docstring)."""

    model: str = DEFAULT_MODEL
    device: str | None = None
    dtype: str | None = None
    kv_cache_gb: float | None = None
    kv_cache_fraction: float | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    prepack_weights: bool = True
    attention_backend: str = AUTO
    cpu_kernels: bool = True
    fuse_mlp: bool = True
    native_layers: bool | None = None
    compile: bool = False
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    quantization: str = AUTO
    quantization_max_rows: int | None = None
    batch_invariant: bool = False

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
        if self.compile and self.quantization in QUANTIZED:
            raise ValueError(
                f"compile cannot honour quantization {self.quantization!r}: the compiled layer "
                "calls the full-precision linears; drop one of them"
            )
        conflicts = self.conflicts_with_batch_invariance()
        if self.batch_invariant and conflicts:
            raise ValueError(
                f"batch_invariant cannot be honoured with {', '.join(conflicts)}: those paths "
                "choose their kernels by the step's rows (docs/batch-invariance.md); drop one"
            )
        unhonoured = self.unsupported_by_tensor_parallel()
        if self.tensor_parallel_size > 1 and unhonoured:
            raise ValueError(
                f"tensor parallelism cannot honour {', '.join(unhonoured)}: its ranks run the "
                "eager forward, whose row-parallel linears all-reduce between the kernels "
                "(docs/parallelism.md); drop it or use tensor_parallel_size 1"
            )

    def unsupported_by_tensor_parallel(self) -> list[str]:
        """The settings given here that a tensor-parallel rank cannot honour."""
        names = []
        if self.compile:
            names.append("compile")
        if self.native_layers:
            names.append("native_layers")
        if self.quantization in QUANTIZED:
            names.append("quantization")
        return names

    def conflicts_with_batch_invariance(self) -> list[str]:
        """The settings given here that `batch_invariant` cannot run with."""
        named = {
            "quantization": self.quantization in QUANTIZED,
            "compile": self.compile,
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "cpu_kernels": not self.cpu_kernels,
            "prepack_weights": not self.prepack_weights,
            "attention_backend": self.attention_backend not in (AUTO, "cpu_paged"),
        }
        return [name for name, conflicts in named.items() if conflicts]
