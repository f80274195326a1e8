"""The native decode stack (stacks/native.py): decode-only steps in one call, bit for bit the
Python loop's logits (with `--quantization`'s int4 and int8 copies too), and only where that
loop would call exactly its kernels."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch

from backends.torch import cpu_kernels
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.model import PagedCausalLM, attention_specs
from backends.torch.quantization import quantize as quantization
from backends.torch.quantization.gguf_int4 import GROUP_SIZE, Int4Blocks
from backends.torch.quantization.quantize import PROJECTIONS
from backends.torch.quantization.weights import Int4Weight, Int8Weight, QuantizedWeight
from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.inputs import prepare_inputs
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from schedulers.batch import Batch
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

pytestmark = pytest.mark.skipif(cpu_kernels.native() is None, reason="no CPU kernels here")

CPU = torch.device("cpu")
BLOCK = 4
NUM_BLOCKS = 1400


def paged_cache(model: torch.nn.Module, dtype: torch.dtype) -> KVCache:
    spec = attention_specs(model)[0]  # type: ignore[arg-type]
    layout = KVLayout(len(model.model.layers), spec.num_kv_heads, spec.head_dim, BLOCK, dtype)
    return KVCache(layout, NUM_BLOCKS, CPU)


class CountingStack:
    """The native stack's calls counted (and how many were quantised), each passed on."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.calls, self.quantized_calls = stack, 0, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        self.quantized_calls += bool(args[-1])
        out: torch.Tensor = self.stack.forward(*args)
        return out


QUANTIZED_ROWS = 7


def random_int4_copies(
    hf_model: Any, mode: str, ref: str, linears: Any, leave_out: str = ""
) -> dict[str, QuantizedWeight]:
    """`quantization.quantized_copies` for a tiny model, which has no GGUF: random 4-bit blocks
    of each projection's shape (the same on every call), an int8 LM head; `leave_out`: no copy
    of that projection in layer 0."""
    gen = torch.Generator().manual_seed(0)
    dtype = hf_model.lm_head.weight.dtype
    out: dict[str, QuantizedWeight] = {}
    for i, lin in enumerate(linears):
        for key in PROJECTIONS:
            n, k = getattr(lin, key).weight.shape
            groups = (n, k // GROUP_SIZE)
            blocks = Int4Blocks(
                torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                torch.rand(groups, generator=gen) * 0.02,
                (torch.rand(groups, generator=gen) - 0.5) * 0.02,
            )
            if (i, key) != (0, leave_out):
                out[f"layers.{i}.{key}"] = Int4Weight(blocks, dtype, CPU)
    out["lm_head"] = Int8Weight(hf_model.lm_head.weight)
    return out


def sequences(rng: random.Random, count: int) -> list[Sequence]:
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # scattered blocks, as a long-running cache has them
    seqs = []
    for i in range(count):
        prompt = [rng.randrange(200) for _ in range(rng.randint(1, 9))]
        seq = Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=8))
        seq.block_table = [free.pop() for _ in range(5)]  # room for 20 tokens
        seqs.append(seq)
    return seqs


def quantized_fields(quantized: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """PagedCausalLM keywords for `quantized` (none, int8, or int4 from random blocks)."""
    if quantized == "none":
        return {"quantization": "none"}
    if quantized == "int4":
        monkeypatch.setattr(quantization, "quantized_copies", random_int4_copies)
    return {"quantization": "int8", "quantization_max_rows": QUANTIZED_ROWS}


def prefill_of(seqs: list[Sequence]) -> Batch:
    batch = Batch(0)
    for seq in seqs:
        batch.add(seq, seq.num_prompt_tokens)
    return batch


def decodes_of(seqs: list[Sequence]) -> Batch:
    batch = Batch(0)
    for seq in seqs:
        batch.add(seq, 1)
    return batch


def step_both(native: PagedCausalLM, loop: PagedCausalLM, batch: Batch) -> None:
    """One step of `batch` on both models: the same logits bit for bit; greedy tokens kept."""
    inputs = prepare_inputs(batch, BLOCK, CPU)
    args = (inputs.input_ids, inputs.positions, inputs.layout)
    got, want = native(*args), loop(*args)
    assert torch.equal(got, want)
    for seq, token in zip(batch.seqs, want.argmax(-1).tolist(), strict=True):
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(token)


@pytest.mark.parametrize("quantized", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_decode_steps_through_the_stack_give_the_python_loops_logits_bit_for_bit(
    arch: str, dtype: torch.dtype, quantized: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mistral and qwen2 slide their windows (qwen2 per layer, with QKV biases); contexts
    outgrow them. One decode past the pack plan's rows (128; 256 in bf16 on AMX) takes the
    loop, not the stack. Quantised: steps of at most 7 rows take the int8 or int4 copies, in
    the stack as in the loop."""
    model = tiny_model(arch).to(dtype)
    with torch.no_grad():  # norms of their own per layer (a tiny model's start all ones)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    fields = quantized_fields(quantized, monkeypatch)
    native = PagedCausalLM(model, paged_cache(model, dtype), **fields)
    loop = PagedCausalLM(model, paged_cache(model, dtype), native_layers=False, **fields)
    assert native.native_layers is not None and loop.native_layers is None
    counting = CountingStack(native.native_layers.stack)
    native.native_layers.stack = counting
    assert native._plan is not None
    most = native._plan.max_rows
    seqs = sequences(random.Random(arch), most + 1)
    step_both(native, loop, prefill_of(seqs))  # prefills: the loop on both sides
    assert counting.calls == 0
    for num_decodes in (1, 2, QUANTIZED_ROWS, QUANTIZED_ROWS + 1, 33, most, most + 1, most):
        step_both(native, loop, decodes_of(seqs[:num_decodes]))
    assert counting.calls == 7  # every decode-only step but the one past the plan
    assert counting.quantized_calls == (0 if quantized == "none" else 3)


def test_quantised_steps_the_stack_cannot_run_as_the_loop_does_take_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 0's gate quantised without its up: the stack runs the steps past the quantised
    rows only, and every step still equals the loop's."""

    def gate_without_up(*args: Any) -> dict[str, QuantizedWeight]:
        return random_int4_copies(*args, leave_out="up")

    monkeypatch.setattr(quantization, "quantized_copies", gate_without_up)
    model = tiny_model("llama").to(torch.bfloat16)
    fields = {"quantization": "int8", "quantization_max_rows": QUANTIZED_ROWS}
    native = PagedCausalLM(model, paged_cache(model, torch.bfloat16), **fields)
    loop = PagedCausalLM(model, paged_cache(model, torch.bfloat16), native_layers=False, **fields)
    assert native.native_layers is not None
    assert native.native_layers.quantized_rows == 0
    counting = CountingStack(native.native_layers.stack)
    native.native_layers.stack = counting
    seqs = sequences(random.Random(1), 8)
    step_both(native, loop, prefill_of(seqs))
    for batch_size in (1, 8, 3):
        step_both(native, loop, decodes_of(seqs[:batch_size]))
    assert (counting.calls, counting.quantized_calls) == (1, 0)  # the 8-row step only


def test_the_stack_stays_out_where_the_loop_would_call_other_kernels() -> None:
    model = tiny_model("llama")
    cache = paged_cache(model, torch.float32)
    assert PagedCausalLM(model, cache, native_layers=False).native_layers is None
    assert PagedCausalLM(model, cache, attention_backend="sdpa").native_layers is None
    assert PagedCausalLM(model, cache, prepack_weights=False).native_layers is None
    assert PagedCausalLM(model, cache, fuse_mlp=False).native_layers is None
    assert PagedCausalLM(model, cache, cpu_kernels=False).native_layers is None
    qwen3 = tiny_model("qwen3")  # a norm per head before rotary
    assert PagedCausalLM(qwen3, paged_cache(qwen3, torch.float32)).native_layers is None
    # tensor parallelism's row-parallel linears all-reduce between the kernels: the loop
    placed = PagedCausalLM(model, cache, placement=IdentityPlacement())
    assert placed.native_layers is None and placed.stack.name == "eager"


class IdentityPlacement:
    """A placement (linears.py) that keeps every op as it is: a one-rank tensor parallelism."""

    def row_parallel(self, linear: Any) -> Any:
        return linear

    def lm_head(self, linear: Any) -> Any:
        return linear

    def embedding(self, embed: Any) -> Any:
        return embed


def test_closing_the_backend_frees_the_kv_cache_the_stack_held() -> None:
    backend = TorchBackend(
        tiny_model("llama"), tiny_tokenizer(), device="cpu", dtype="float32", kv_cache_gb=0.01
    )
    assert backend.model.native_layers is not None
    k_cache = weakref.ref(backend.kv_cache.k[0])
    backend.close()
    gc.collect()
    assert k_cache() is None  # nothing (the stack included) keeps the KV memory alive
