"""Tensor-parallel pieces without processes: which sizes split a model, what each rank's
shard holds (read from safetensors), and the flat step metadata every rank rebuilds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.torch.parallel.shard import load_shard
from backends.torch.parallel.sizes import ModelDims, ShardPlan, check_tensor_parallel_size
from backends.torch.parallel.step import FlatStep
from backends.torch.testing.tiny_models import ARCHITECTURES, TINY, tiny_model
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.test_oracle import make_backend

SMOLLM2 = ModelDims(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152)  # fmt: skip


def test_valid_sizes_of_the_default_model_and_the_tiny_ones() -> None:
    assert SMOLLM2.valid_sizes() == [1, 3]
    assert ModelDims.of(tiny_model("llama").config).valid_sizes() == [1, 2, 4]
    with pytest.raises(ValueError, match="valid sizes: 1, 3") as refused:
        check_tensor_parallel_size(SMOLLM2, 2)
    assert "9 attention heads" in str(refused.value) and "3 KV heads" in str(refused.value)


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    dims = ModelDims.of(tiny_model("llama").config)  # 4 heads, 2 KV heads
    plans = [ShardPlan(dims, r, 4) for r in range(4)]
    assert [list(p.q_heads) for p in plans] == [[0], [1], [2], [3]]
    # query head h reads KV head h // 2 (GQA), so ranks 0, 1 hold KV head 0 and 2, 3 head 1
    assert [list(p.kv_heads) for p in plans] == [[0], [0], [1], [1]]
    assert [list(p.kv_heads) for p in (ShardPlan(dims, r, 2) for r in range(2))] == [[0], [1]]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_whole_model(arch: str, size: int, tmp_path: Path) -> None:
    model = tiny_model(arch)
    model.save_pretrained(tmp_path)
    dims = ModelDims.of(model.config)
    shards = [load_shard(tmp_path, ShardPlan(dims, r, size), torch.float32) for r in range(size)]
    whole = model.state_dict()
    for name in ("q_proj", "k_proj", "v_proj"):
        parts = [s.state_dict()[f"model.layers.1.self_attn.{name}.weight"] for s in shards]
        if name != "q_proj" and size > dims.num_kv_heads:
            parts = parts[:: size // dims.num_kv_heads]  # one copy of each replicated head
        assert torch.equal(torch.cat(parts), whole[f"model.layers.1.self_attn.{name}.weight"])
    for name, dim in (("self_attn.o_proj", 1), ("mlp.gate_proj", 0), ("mlp.down_proj", 1)):
        key = f"model.layers.0.{name}.weight"
        assert torch.equal(torch.cat([s.state_dict()[key] for s in shards], dim), whole[key])
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([s.state_dict()[key] for s in shards]), whole[key])
    norm = "model.layers.0.input_layernorm.weight"
    assert all(torch.equal(s.state_dict()[norm], whole[norm]) for s in shards)
    if arch == "qwen2":
        key = "model.layers.0.self_attn.q_proj.bias"
        assert torch.equal(torch.cat([s.state_dict()[key] for s in shards]), whole[key])
    assert shards[0].config.num_key_value_heads == max(1, dims.num_kv_heads // size)


def test_tied_embeddings_share_one_vocabulary_shard(tmp_path: Path) -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    shard = load_shard(tmp_path, ShardPlan(ModelDims.of(model.config), 1, 2), torch.float32)
    assert shard.lm_head.weight is shard.model.embed_tokens.weight
    assert torch.equal(shard.lm_head.weight, model.model.embed_tokens.weight[160:])


def test_flat_step_rebuilds_exactly_what_prepare_builds() -> None:
    backend = make_backend(tiny_model("llama"))
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size)
    params = SamplingParams(max_tokens=8)
    seqs = [Sequence(i, f"r{i}", list(range(5 + 7 * i)), params) for i in range(3)]
    batch = Batch(iteration=0)
    for seq, n in zip(seqs, (5, 1, 9), strict=True):  # a prefill, a decode, a chunk
        seq.num_computed_tokens = {0: 0, 1: 11, 2: 4}[seq.seq_id]
        blocks.allocate(seq, seq.num_computed_tokens + n)
        batch.add(seq, n)
    inputs = backend.prepare(batch)
    step = FlatStep.of(inputs, [0, 2])
    again = FlatStep.unpack(step.sizes, step.pack())
    rebuilt, rows = again.model_input(spec.block_size, backend.device)
    assert torch.equal(rebuilt.input_ids, inputs.input_ids)
    assert torch.equal(rebuilt.positions, inputs.positions)
    assert rows is not None and rows.tolist() == [0, 2]
    for field in inputs.layout.__dataclass_fields__:
        got, want = getattr(rebuilt.layout, field), getattr(inputs.layout, field)
        same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
        assert same, field
    assert FlatStep.unpack(step.sizes, step.pack()).sizes == step.sizes
