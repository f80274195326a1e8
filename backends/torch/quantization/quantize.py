"""`--quantization`: which weight-only quantised copies a model's linears get, and when they run.

- `gguf`: a GGUF model's own Q4_0 / Q4_1 / Q4_K blocks through torch's int4 kernel
  (gguf_int4.py); weights of other block types keep the dequantised copy only, except the LM
  head (SmolLM2's tied Q8_0 embedding), which is requantised per output channel to int8;
- `int8`: every linear and the LM head quantised per output channel (weight-only int8);
- `none`: the full-precision weights only (today's path, and the fp32 HF oracle's);
- `auto` (the default): `gguf` for a model loaded from a GGUF file, else `none`; but `none`
  where quantised linears cannot run (tensor parallelism, `--compile`) or must not
  (`batch_invariant`: a row's kernel would depend on the step's rows). The rule never
  reads the switches that choose among Carousel's paths (`cpu_kernels`, `native_layers`,
  `fuse_mlp`, `prepack_weights`), so an A/B of one of those never also swaps the weights;
  `gguf` forces the blocks. With Carousel's CPU kernels the quantised steps run in the native
  decode stack (stacks/native.py): one sequence's step 1.2-1.5x faster than bf16 on the 2-core
  Zen 4, steps past `R` the same (docs/benchmarks.md).

Each quantised linear (layers/quant_linear.py) takes its kernel for steps of at most `R` rows
and the full-precision weight otherwise. `R` is measured at load (`measure_max_rows`: both
paths over every layer's linears, and over the LM head, at 1, 2, 4, ... rows; logged) unless
`quantization_max_rows` sets it; a copy whose `R` is 0 is dropped. Arms sharing one loaded
model and asking for the same quantisation share the quantised copies and the measured `R`:
measured per arm, a noisy machine gave two arms of one A/B different weights (R = 0 and 8),
so a comparison of anything else also compared int4 against bf16.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.config import QUANTIZATIONS, TorchBackendConfig
from backends.torch.layers.linear import Linear
from backends.torch.layers.quant_linear import QuantLinear
from backends.torch.loader import gguf_int4, gguf_source
from backends.torch.logs import engine_log
from backends.torch.models import weights_of
from backends.torch.models.base import PROJECTIONS
from backends.torch.quantization.gguf_int4 import Int4Blocks
from backends.torch.quantization.weights import Int4Weight, Int8Weight, QuantizedWeight

log = engine_log()

AUTO, GGUF, INT8, NONE = QUANTIZATIONS
#: row counts `measure_max_rows` tries, in order (a step past the last takes bf16 anyway)
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64)
_CACHE_ATTR = "_carousel_quantized"
#: arms load on their own threads: one builds what they share while the others wait for it
_SHARED_LOCK = threading.RLock()


@dataclass
class QuantizationReport:
    """What a model's quantisation came to: logged at load, weight bytes on /metrics."""

    mode: str
    layer_max_rows: int = 0
    lm_head_max_rows: int = 0
    #: how many times faster every layer's quantised linears run than the dense ones at
    #: `layer_max_rows` rows (1.0: none run); the linears alone, so above the whole step's
    layer_speedup: float = 1.0
    weight_bytes: dict[str, int] = field(default_factory=dict)


def from_gguf_file(hf_model: PreTrainedModel, ref: str) -> bool:
    """Whether `hf_model` is the converted model of the GGUF `ref` names."""
    try:
        source = gguf_source(ref)
    except FileNotFoundError:
        return False
    loaded_from = str(getattr(hf_model, "name_or_path", "") or "")
    return source is not None and loaded_from == str(source[1])


def resolve_mode(hf_model: PreTrainedModel, config: TorchBackendConfig) -> str:
    """`config.quantization` with `auto` settled; raises ValueError for `gguf` on no GGUF."""
    mode = config.quantization
    if mode == AUTO:
        # NOTE: never under tensor parallelism, --compile or batch invariance (int4 only for
        # steps of <= R rows): the config says which (TorchBackendConfig.unhonoured)
        honoured = config.honours_quantization
        return GGUF if honoured and from_gguf_file(hf_model, config.model) else NONE
    if mode == GGUF and not from_gguf_file(hf_model, config.model):
        raise ValueError(
            f"quantization 'gguf' needs a GGUF model (the default or a .gguf file), not "
            f"{config.model!r}: use 'int8' or 'none'"
        )
    return mode


def _shared(hf_model: PreTrainedModel, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """`build()` once per loaded model and `key` (arms sharing the weights share it)."""
    with _SHARED_LOCK:
        cache: dict[tuple[Any, ...], Any] = hf_model.__dict__.setdefault(_CACHE_ATTR, {})
        if key not in cache:
            cache[key] = build()
        return cache[key]


def _int4_copies(
    hf_model: PreTrainedModel, ref: str, dtype: torch.dtype, device: torch.device
) -> dict[str, QuantizedWeight]:
    """Per `layers.{i}.{projection}` and `lm_head`: the GGUF's 4-bit blocks, packed."""
    blocks = gguf_int4(ref)
    weights = weights_of(hf_model)
    out: dict[str, QuantizedWeight] = {}
    for layer in weights.layers:
        for key in PROJECTIONS:
            names = layer.checkpoint_names.get(key, ())
            found = [blocks[n] for n in names if n in blocks]
            if names and len(found) == len(names):  # q, k and v all, for qkv
                joined = found[0] if len(found) == 1 else Int4Blocks.cat(found)
                out[f"layers.{layer.index}.{key}"] = Int4Weight(joined, dtype, device)
    head = next((blocks[n] for n in weights.lm_head_names if n in blocks), None)
    lm_head = weights.lm_head_weight
    out["lm_head"] = Int4Weight(head, dtype, device) if head is not None else Int8Weight(lm_head)
    return out


def _int8_copies(hf_model: PreTrainedModel, linears: Sequence[Any]) -> dict[str, QuantizedWeight]:
    out: dict[str, QuantizedWeight] = {}
    for i, lin in enumerate(linears):
        for key in PROJECTIONS:
            out[f"layers.{i}.{key}"] = Int8Weight(getattr(lin, key).weight)
    out["lm_head"] = Int8Weight(weights_of(hf_model).lm_head_weight)
    return out


def quantized_copies(
    hf_model: PreTrainedModel, mode: str, ref: str, linears: Sequence[Any]
) -> dict[str, QuantizedWeight]:
    """The quantised weights `mode` gives this model, built once per model, mode and dtype."""
    weight = weights_of(hf_model).lm_head_weight
    key = (mode, ref, weight.dtype, weight.device)

    def build() -> dict[str, QuantizedWeight]:
        if mode == GGUF:
            return _int4_copies(hf_model, ref, weight.dtype, weight.device)
        return _int8_copies(hf_model, linears)

    copies: dict[str, QuantizedWeight] = _shared(hf_model, key, build)
    return copies


def _check_shape(key: str, dense: Linear, quantized: QuantizedWeight) -> None:
    expected = tuple(dense.weight.shape)
    got = (quantized.out_features, quantized.in_features)
    if got != expected:
        raise ValueError(f"the quantised {key} is {got}, the model's weight {expected}")


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    began = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


@dataclass(frozen=True)
class Pair:
    """One piece of a step both ways: `dense` and `quantized` each map (rows, in_features) to
    the same output."""

    dense: Callable[[torch.Tensor], torch.Tensor]
    quantized: Callable[[torch.Tensor], torch.Tensor]
    in_features: int


def linear_pair(dense: Linear, quantized: QuantizedWeight) -> Pair:
    return Pair(dense, quantized.mm, quantized.in_features)


@torch.inference_mode()
def measure_max_rows(
    pairs: Sequence[Pair],
    device: torch.device,
    dtype: torch.dtype,
    reps: int = 3,
    speedups: dict[int, float] | None = None,
) -> int:
    """The most rows for which the quantised kernels beat the dense weights at every row count
    up to it; 0: never. `speedups`, where given, receives each timed row count's speedup (as
    `measure_speedup` gives it), so the caller need not time the chosen one again.

    Each side runs all of `pairs` in turn, as a step streams every layer's weights from memory
    (one weight alone sits in cache, which flatters the dense side); the sides alternate
    `reps` times and each keeps its fastest pass (the one least disturbed by other work).
    """
    if not pairs:
        return 0
    best = 0
    for rows in CANDIDATE_ROWS:
        dense_s, quantized_s = _time_both(pairs, rows, device, dtype, reps)
        if speedups is not None:
            speedups[rows] = dense_s / quantized_s
        if quantized_s >= dense_s:
            break
        best = rows
    return best


@torch.inference_mode()
def measure_speedup(
    pairs: Sequence[Pair], rows: int, device: torch.device, dtype: torch.dtype, reps: int = 3
) -> float:
    """How many times faster the quantised side runs all of `pairs` at `rows` rows than the
    dense side (as `measure_max_rows` times them); 1.0 for no pairs or rows."""
    if not pairs or rows < 1:
        return 1.0
    dense_s, quantized_s = _time_both(pairs, rows, device, dtype, reps)
    return dense_s / quantized_s


def _time_both(
    pairs: Sequence[Pair], rows: int, device: torch.device, dtype: torch.dtype, reps: int
) -> tuple[float, float]:
    """(dense, quantised) seconds of one pass over `pairs` at `rows` rows: the sides
    alternate `reps` times and each keeps its fastest pass."""
    inputs = {
        k: torch.randn(rows, k, device=device, dtype=dtype)
        for k in {pair.in_features for pair in pairs}
    }
    run_dense, run_quantized = _passes(pairs, inputs)
    dense_s = quantized_s = float("inf")
    for _ in range(reps):
        dense_s = min(dense_s, _timed(run_dense, device))
        quantized_s = min(quantized_s, _timed(run_quantized, device))
    return dense_s, quantized_s


def _passes(
    pairs: Sequence[Pair], inputs: dict[int, torch.Tensor]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One pass over every pair's dense side, and one over its quantised side."""

    def run_dense() -> None:
        for pair in pairs:
            pair.dense(inputs[pair.in_features])

    def run_quantized() -> None:
        for pair in pairs:
            pair.quantized(inputs[pair.in_features])

    return run_dense, run_quantized


def _all_pairs(linears: Sequence[Any], copies: dict[str, QuantizedWeight]) -> list[Pair]:
    """Every layer's projections both ways, in the forward's order, each side as a step runs
    it: where the MLP's gate and up are packed together (`gate_up`, one kernel that also
    applies silu), the dense side is that kernel and the quantised side both copies and the
    activation; timing the plain gate and up weights instead (torch's F.linear, which such a
    step never calls) made the dense side look slower than it is."""
    pairs = []
    for i, lin in enumerate(linears):
        quantized = {
            k: copies[f"layers.{i}.{k}"] for k in PROJECTIONS if f"layers.{i}.{k}" in copies
        }
        fused = lin.gate_up is not None and "gate" in quantized and "up" in quantized
        for key, weight in quantized.items():
            if fused and key == "gate":
                up = quantized["up"]
                pairs.append(Pair(lin.gate_up, _silu_mul(weight, up), weight.in_features))
            elif not (fused and key == "up"):
                pairs.append(linear_pair(getattr(lin, key), weight))
    return pairs


def _silu_mul(gate: QuantizedWeight, up: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate.mm(x)) * up.mm(x)

    return run


def _measured_rows(
    linears: Sequence[Any],
    copies: dict[str, QuantizedWeight],
    lm_head: Linear,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[int, int, float | None]:
    """(the layers' R, the LM head's R, the layers' speedup at their R where it was timed)."""
    timed: dict[int, float] = {}
    layer_rows = measure_max_rows(_all_pairs(linears, copies), device, dtype, speedups=timed)
    head_rows = measure_max_rows([linear_pair(lm_head, copies["lm_head"])], device, dtype)
    return layer_rows, head_rows, timed.get(layer_rows)


def quantize_linears(
    hf_model: PreTrainedModel,
    config: TorchBackendConfig,
    mode: str,
    linears: Sequence[Any],
    lm_head: Linear,
) -> tuple[list[dict[str, Any]], Any, QuantizationReport]:
    """Each layer's projections and the LM head, with their quantised copies where `mode` (the
    `resolve_mode` of `config`) asks for them: ([{projection: op}] per layer, LM head, report).
    """
    weight = lm_head.weight
    device, dtype = weight.device, weight.dtype
    plain = [{k: getattr(lin, k) for k in PROJECTIONS} for lin in linears]
    packed = [lm_head.packed, *(lin.packed for layer in plain for lin in layer.values())]
    packed += [lin.gate_up.packed for lin in linears if lin.gate_up is not None]
    report = QuantizationReport(mode)
    if mode == NONE:
        report.weight_bytes = weight_bytes(hf_model, packed, {})
        return plain, lm_head, report
    copies = quantized_copies(hf_model, mode, config.model, linears)
    for key, quantized in copies.items():
        layer, _, name = key.rpartition(".")
        dense = lm_head if key == "lm_head" else plain[int(layer.split(".")[1])][name]
        _check_shape(key, dense, quantized)
    fixed = config.quantization_max_rows
    began = time.monotonic()
    layout = tuple(lin.gate_up is not None for lin in linears)
    timed: float | None = None  # the layers' speedup at R, where the measurement of R gave it
    if fixed is not None:
        layer_rows = head_rows = fixed
    else:  # once per loaded model and layout: every arm serving it takes the same weights
        layer_rows, head_rows, timed = _shared(
            hf_model, ("max_rows", mode, str(device), dtype, layout),
            lambda: _measured_rows(linears, copies, lm_head, device, dtype),
        )  # fmt: skip
    speedup = 1.0
    if layer_rows > 0:
        speedup = _shared(
            hf_model, ("speedup", mode, str(device), dtype, layout, layer_rows),
            lambda: timed if timed is not None
            else measure_speedup(_all_pairs(linears, copies), layer_rows, device, dtype),
        )  # fmt: skip
    aten = kernels  # torch's weight-only ops are named in kernels.py
    ops = []
    for i, projections in enumerate(plain):
        ops.append({
            k: QuantLinear(dense, copies[f"layers.{i}.{k}"], layer_rows, device, aten)
            if layer_rows > 0 and f"layers.{i}.{k}" in copies else dense
            for k, dense in projections.items()
        })  # fmt: skip
    head: Any = lm_head
    if head_rows > 0:
        head = QuantLinear(lm_head, copies["lm_head"], head_rows, device, aten)
    kept = {k: v for k, v in copies.items()
            if (head_rows if k == "lm_head" else layer_rows) > 0}  # fmt: skip
    report.layer_max_rows, report.lm_head_max_rows = layer_rows, head_rows
    report.layer_speedup = speedup
    report.weight_bytes = weight_bytes(hf_model, packed, kept)
    log.info(
        "quantised linears",
        quantization=mode,
        layer_max_rows=layer_rows,
        lm_head_max_rows=head_rows,
        layer_speedup=round(speedup, 2),
        measured=fixed is None,
        seconds=round(time.monotonic() - began, 2),
        weight_bytes=report.weight_bytes,
    )
    return ops, head, report


def weight_bytes(
    hf_model: PreTrainedModel,
    packed: Sequence[torch.Tensor | None],
    quantized: dict[str, QuantizedWeight],
) -> dict[str, int]:
    """Resident weight bytes per format: the model's parameters and prepacked copies under
    their dtype (`bfloat16`, ...), each quantised format under its name (`int4`, `int8`)."""
    seen: set[int] = set()
    dense = 0
    for param in hf_model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            dense += param.numel() * param.element_size()
    for copy in {id(c): c for c in packed if c is not None}.values():  # oneDNN's: no data_ptr
        dense += copy.numel() * copy.element_size()
    dtype = weights_of(hf_model).lm_head_weight.dtype
    out = {str(dtype).removeprefix("torch."): dense}
    for weight in {id(q): q for q in quantized.values()}.values():
        out[weight.format] = out.get(weight.format, 0) + weight.nbytes
    return out
