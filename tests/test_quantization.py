"""`--quantization`: quantised copies run for small steps only, `auto` leaves non-GGUF models
alone, what a backend cannot honour is refused, and the weight bytes per format are reported."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import PreTrainedModel

from backends.torch.config import TorchBackendConfig
from backends.torch.layers.linear import Linear
from backends.torch.layers.quant_linear import QuantLinear
from backends.torch.quantization.weights import Int8Weight
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from gateway.obs.metrics import ArmGauges, GatewayMetrics
from gateway.settings.load import Settings
from schedulers.backend import FastRows
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

CPU = torch.device("cpu")


def kernels_off() -> bool:
    from backends.torch import kernels

    return kernels.native() is None


def test_a_step_of_at_most_max_rows_takes_the_quantised_weight_and_larger_ones_the_dense() -> None:
    dense = Linear(torch.randn(16, 32))
    other = Int8Weight(torch.randn(16, 32))  # a different matrix: which one ran is visible
    op = QuantLinear(dense, other, max_rows=4, device=CPU, kernels=torch)  # type: ignore[arg-type]
    small, big = torch.randn(4, 32), torch.randn(5, 32)
    torch.testing.assert_close(op(small), other.mm(small))
    torch.testing.assert_close(op(big), dense(big))
    never = QuantLinear(dense, other, max_rows=0, device=CPU, kernels=torch)  # type: ignore[arg-type]
    torch.testing.assert_close(never(small), dense(small))


def backend(**fields: object) -> TorchBackend:
    model = tiny_model("llama")
    return TorchBackend(
        model, tiny_tokenizer(), device="cpu", dtype="bfloat16", kv_cache_gb=0.01,
        max_model_len=64, **fields,
    )  # fmt: skip


def step_logits(b: TorchBackend, prompt: list[int]) -> torch.Tensor:
    """Logits of a one-row decode step after `prompt` (prefilled first)."""
    spec = b.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size)
    seq = Sequence(0, "q", prompt, SamplingParams(max_tokens=4))
    blocks.allocate(seq, len(prompt))
    batch = Batch(0)
    batch.add(seq, len(prompt) - 1)
    b.logits(batch)
    seq.num_computed_tokens = len(prompt) - 1
    blocks.allocate(seq, len(prompt))
    batch = Batch(0)
    batch.add(seq, 1)
    out = b.logits(batch)
    blocks.free(seq)
    return out


def test_auto_leaves_a_model_that_is_no_gguf_as_it_is() -> None:
    b = backend()
    assert b.model.quantization.mode == "none"
    assert set(b.weight_bytes) == {"bfloat16"}
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF model"):
        backend(quantization="gguf")


def test_int8_decode_steps_stay_close_to_the_dense_model_and_report_their_bytes() -> None:
    prompt = [5, 17, 42, 99, 7, 3]
    dense = step_logits(backend(quantization="none"), prompt)
    b = backend(quantization="int8", quantization_max_rows=8)
    assert b.model.quantization.layer_max_rows == 8
    # the drafter's view: R and the speedup measured there (speculative decoding's fit)
    report = b.model.quantization
    assert b.fast_rows == FastRows(8, report.layer_speedup) and report.layer_speedup > 0
    assert backend(quantization="none").fast_rows is None
    assert isinstance(b.model.linears[0].qkv, QuantLinear)
    quantised = step_logits(b, prompt)
    assert not torch.equal(quantised, dense)  # the int8 kernel ran
    assert (quantised - dense).abs().max() <= 0.05 * dense.abs().max()
    assert b.weight_bytes["int8"] > 0
    assert b.weight_bytes["int8"] < b.weight_bytes["bfloat16"] / 2


def test_what_cannot_run_quantised_linears_refuses_them() -> None:
    with pytest.raises(ValidationError, match="sim cannot honour quantization"):
        Settings(backend="sim", quantization="gguf")
    with pytest.raises(ValidationError, match="cannot honour quantization"):
        Settings(tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValidationError, match="cannot honour quantization"):
        Settings(compile=True, quantization="gguf")
    with pytest.raises(ValueError, match="tensor parallelism cannot honour quantization"):
        TorchBackendConfig(tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        TorchBackendConfig(quantization="int3")
    Settings(tensor_parallel_size=2)  # auto: full precision on the ranks
    Settings(compile=True)


def test_metrics_report_weight_bytes_per_format() -> None:
    gauges = ArmGauges("m", "a", 0, 0, 0.0, 0.0, {"bfloat16": 100, "int4": 25})
    text = GatewayMetrics(arm_gauges=lambda: [gauges]).render().decode()
    assert 'carousel_weight_bytes{arm="a",format="int4",model="m"} 25.0' in text
    assert 'carousel_weight_bytes{arm="a",format="bfloat16",model="m"} 100.0' in text


def gguf_model() -> PreTrainedModel:
    """A tiny bf16 model that passes for the conversion of the default (embedded) GGUF."""
    from backends.torch.loader import gguf_source

    model = tiny_model("llama").to(torch.bfloat16)
    source = gguf_source("default")
    assert source is not None
    model.name_or_path = str(source[1])
    return model


@pytest.mark.parametrize("kernels_compute", [True, False])
def test_auto_serves_a_ggufs_blocks_whatever_the_switches_among_carousels_paths_say(
    monkeypatch: pytest.MonkeyPatch, kernels_compute: bool
) -> None:
    from backends.torch import kernels
    from backends.torch.quantization.quantize import resolve_mode

    monkeypatch.setattr(kernels, "computes", lambda dtype, device_type="cpu": kernels_compute)
    model = gguf_model()
    switches = [{}, {"native_layers": False}, {"cpu_kernels": False}, {"fuse_mlp": False},
                {"prepack_weights": False}]  # fmt: skip
    for fields in switches:  # an A/B of any of these keeps the weights of the other arm
        assert resolve_mode(model, TorchBackendConfig(**fields)) == "gguf", fields  # type: ignore[arg-type]
    assert resolve_mode(model, TorchBackendConfig(compile=True)) == "none"
    assert resolve_mode(model, TorchBackendConfig(quantization="none")) == "none"
    assert resolve_mode(tiny_model("llama"), TorchBackendConfig()) == "none"  # no GGUF


@pytest.mark.skipif(kernels_off(), reason="no CPU kernels here")
def test_r_is_timed_on_each_side_as_a_step_runs_it() -> None:
    """Where gate and up are packed together, the dense side of the MLP's first half is that
    one kernel (a step never calls the plain gate and up weights), and each pair's two sides
    compute the same thing up to the int8 rounding."""
    from backends.torch.quantization.quantize import _all_pairs, _int8_copies

    b = backend(quantization="none")
    linears = b.model.linears
    pairs = _all_pairs(linears, _int8_copies(b.hf_model, linears))
    assert all(lin.gate_up is not None for lin in linears)
    assert [p.dense for p in pairs[:4]] == [
        linears[0].qkv,
        linears[0].o_proj,
        linears[0].gate_up,
        linears[0].down,
    ]
    assert len(pairs) == 4 * len(linears)
    for pair in pairs:
        x = torch.randn(3, pair.in_features, dtype=torch.bfloat16)
        dense, quantized = pair.dense(x).float(), pair.quantized(x).float()
        assert (quantized - dense).abs().max() <= 0.05 * dense.abs().max() + 1e-3


def test_arms_sharing_one_model_share_one_measured_max_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two arms over one loaded model (an A/B of anything but quantisation) must serve the same
    weights: the rows threshold is measured once, not once per arm (a noisy machine measured
    R = 0 for one arm and 8 for the other)."""
    from backends.torch.quantization import quantize

    measured = iter([8, 1, 0, 0])  # what a second measurement would (wrongly) give
    calls: list[int] = []

    def measure(
        pairs: object, device: object, dtype: object, reps: int = 3, speedups: object = None
    ) -> int:
        calls.append(1)
        return next(measured)

    monkeypatch.setattr(quantize, "measure_max_rows", measure)
    model = tiny_model("llama")

    def arm() -> TorchBackend:
        return TorchBackend(
            model, tiny_tokenizer(), device="cpu", dtype="bfloat16", kv_cache_gb=0.01,
            max_model_len=64, quantization="int8",
        )  # fmt: skip

    first, second = arm(), arm()
    rows = [(b.model.quantization.layer_max_rows, b.model.quantization.lm_head_max_rows)
            for b in (first, second)]  # fmt: skip
    assert rows == [(8, 1), (8, 1)]
    assert len(calls) == 2  # the layers and the LM head, once


def test_the_measurement_that_chooses_r_gives_its_speedup_without_timing_r_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Known answer: the quantised side takes half the dense time up to 4 rows and twice it at
    8, so R = 4 for the layers and the LM head, the layers' speedup is 2.0, and each row count
    is timed once per side (1, 2, 4, 8 for the layers, the same for the head): none again."""
    from backends.torch.quantization import quantize

    timed: list[int] = []

    def time_both(pairs: object, rows: int, *args: object) -> tuple[float, float]:
        timed.append(rows)
        return (1.0, 0.5) if rows <= 4 else (1.0, 2.0)

    monkeypatch.setattr(quantize, "_time_both", time_both)
    backend = TorchBackend(
        tiny_model("llama"), tiny_tokenizer(), device="cpu", dtype="bfloat16",
        kv_cache_gb=0.01, max_model_len=64, quantization="int8",
    )  # fmt: skip
    report = backend.model.quantization
    assert (report.layer_max_rows, report.lm_head_max_rows) == (4, 4)
    assert report.layer_speedup == 2.0
    assert timed == [1, 2, 4, 8, 1, 2, 4, 8]
