"""bf16 oracle: where kernels legitimately differ from HF's, teacher-forced top-1 agreement.

In bf16 the engine's batched kernels (prepacked matmuls, fused QKV, paged attention) round
differently from HF's own forward, so greedy outputs may part after a near tie. Then the
criterion is the share of positions of fixed texts, teacher-forced through the engine's
batched decode path, whose top-1 token equals HF's bf16 forward's. 99% was the first aim;
on this model bf16 itself is noisier than that: HF's own bf16 forward agrees with its fp32
forward on only about 97% of these positions (docs/benchmarks/history/). So the engine
must agree with HF bf16 at least as well as HF bf16 agrees with HF fp32, less one point.
"""

from __future__ import annotations

import pytest
import torch

from backends.torch.loader import load_model
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.fixed_texts import PASSAGES
from backends.torch.testing.teacher_forcing import engine_logits, hf_logits, top1_agreement
from tests.attention_fixture import EnginePath, engine_path_fixture  # noqa: F401

pytestmark = pytest.mark.real_model
PREFIX = 8


@pytest.fixture(scope="module")
def hf_fp32_logits() -> tuple[list[list[int]], list[torch.Tensor]]:
    """The fixed texts' token ids and HF's fp32 logits over them."""
    model, tokenizer = load_model("default", dtype=torch.float32)
    texts = [list(tokenizer(p)["input_ids"]) for p in PASSAGES]
    return texts, hf_logits(model, texts, PREFIX)


def test_bf16_engine_agrees_with_hf_bf16_as_well_as_bf16_agrees_with_fp32(
    engine_path: EnginePath, hf_fp32_logits: tuple[list[list[int]], list[torch.Tensor]]
) -> None:
    texts, hf32 = hf_fp32_logits
    backend = TorchBackend.load(
        "default", device="cpu", dtype="bfloat16", kv_cache_gb=0.25, max_model_len=512,
        quantization="none", **engine_path.kwargs(),
    )  # fmt: skip
    hf16 = hf_logits(backend.hf_model, texts, PREFIX)
    ours = engine_logits(backend, texts, PREFIX)
    bf16_noise = top1_agreement(hf16, hf32)
    assert bf16_noise > 0.9, "HF's own bf16 forward is off: the yardstick is broken"
    # NOTE: the batch-invariant path attends to a prompt token by token (not SDPA as HF does),
    # so its bf16 rounding is not HF's: it is held to fp32 instead (96.9% here against the
    # default path's 96.6%; 96.4% against HF's bf16, whose own agreement with fp32 is 97.4%)
    reference = hf32 if engine_path.batch_invariant else hf16
    assert top1_agreement(ours, reference) >= bf16_noise - 0.01
    backend.close()
