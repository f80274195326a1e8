"""A GGUF's 4-bit blocks as torch's int4 layout: the mapping equals gguf's own dequantisation,
and torch's int4 kernel multiplies by exactly those weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from backends.torch.quantization.gguf_int4 import (
    Int4Blocks,
    int4_blocks,
    load_int4,
    save_int4,
    unpermute_rows,
)
from backends.torch.quantization.weights import Int4Weight, Int8Weight

BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random ggml blocks of an (n, k) weight, their fp16 scale and min fields small and finite."""
    rng = np.random.default_rng(seed)
    per_block, nbytes = BLOCK_BYTES[type_name]
    blocks = rng.integers(0, 256, size=(n * k // per_block, nbytes), dtype=np.uint8)
    halves = 1 if type_name == "Q4_0" else 2  # d (and m or dmin)
    fields = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], halves)).astype(np.float16)
    blocks[:, : 2 * halves] = fields.view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_blocks_dequantize_as_gguf_does(type_name: str) -> None:
    n, k = 8, 512
    raw = random_blocks(type_name, n, k)
    theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])
    ours = int4_blocks(raw, type_name, (n, k))
    assert int(ours.qweight.max()) <= 15
    np.testing.assert_allclose(ours.dequantize().numpy(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int4_kernel_multiplies_by_the_blocks_weights(dtype: torch.dtype) -> None:
    n, k = 64, 512
    blocks = int4_blocks(random_blocks("Q4_K", n, k, seed=1), "Q4_K", (n, k))
    x = torch.randn(5, k)
    expected = x @ blocks.dequantize().T
    got = Int4Weight(blocks, dtype, torch.device("cpu")).mm(x.to(dtype)).float()
    # fp32: summation order only; bf16: the activations, scales and zeros rounded to bf16
    bound = 1e-4 if dtype == torch.float32 else 0.03
    assert (got - expected).abs().max() <= bound * expected.abs().max()


def test_int8_per_channel_weight_is_within_half_a_step() -> None:
    w = torch.randn(48, 96)
    q = Int8Weight(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(3, 96)
    torch.testing.assert_close(q.mm(x), x @ q.dequantize().T, rtol=1e-4, atol=1e-4)


def test_cached_blocks_read_back_equal(tmp_path: Path) -> None:
    blocks = int4_blocks(random_blocks("Q4_1", 6, 64, seed=2), "Q4_1", (6, 64))
    save_int4({"model.layers.0.mlp.up_proj": blocks}, tmp_path / "int4.safetensors")
    back = load_int4(tmp_path / "int4.safetensors")["model.layers.0.mlp.up_proj"]
    for a, b in zip(
        (back.qweight, back.scale, back.zero),
        (blocks.qweight, blocks.scale, blocks.zero),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_row_order_undoes_llama_cpp_permutation_as_transformers_does() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48 * 3).reshape(48, 3)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(rows, 4, 4)
    ours = rows[unpermute_rows(48, 4).numpy()]
    np.testing.assert_array_equal(ours, theirs)
    blocks = Int4Blocks(torch.zeros(4, 32, dtype=torch.uint8), torch.arange(4.0)[:, None],
                        torch.zeros(4, 1))  # fmt: skip
    assert blocks.rows(torch.tensor([3, 2, 1, 0])).scale[:, 0].tolist() == [3, 2, 1, 0]
