"""Fused QKV weights: one copy of the weights, the HF model unchanged, fused once."""

from __future__ import annotations

import pytest
import torch

from backends.torch.models import weights_of
from backends.torch.testing.tiny_models import ARCHITECTURES, VOCAB, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fusing_keeps_one_copy_and_the_hf_forward_unchanged(arch: str) -> None:
    model = tiny_model(arch).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.inference_mode():
        before = model(ids).logits
    originals = [
        {n: p.detach().clone() for n, p in layer.self_attn.named_parameters()}
        for layer in model.model.layers
    ]
    records = weights_of(model).layers
    for layer, record, original in zip(model.model.layers, records, originals, strict=True):
        fused = record.qkv
        attn = layer.self_attn
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        expected = torch.cat([original[f"{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(fused.weight, expected)
        # the HF params are views into the fused tensor, not a second copy
        base = fused.weight.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base for p in (q, k, v))
        assert (fused.bias is not None) == (attn.q_proj.bias is not None)
        if fused.bias is not None:  # Qwen2 projections carry biases
            assert attn.v_proj.bias.untyped_storage().data_ptr() == (
                fused.bias.untyped_storage().data_ptr()
            )
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_fusing_twice_reuses_the_fused_tensor_until_the_model_is_cast() -> None:
    model = tiny_model("llama")
    layer = model.model.layers[0]
    first = weights_of(model).layers[0].qkv
    assert weights_of(model).layers[0].qkv is first  # a second backend over shared weights
    model.to(torch.float64)  # new parameter tensors: the old fused copy is stale
    again = weights_of(model).layers[0].qkv
    assert again is not first and again.weight.dtype == torch.float64
    assert again.weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
