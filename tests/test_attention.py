"""The attention seam: every backend attends like plain softmax attention over the logical context.

The reference here is written from the definition (each token, each head, a softmax over its
own sequence's keys up to its position, within the sliding window), independent of SDPA, and
the batch mixes what the backends treat differently: fresh prefills, a prefill chunk over a
cached context, decodes of many lengths (block-aligned, one token, beyond a window) over
scattered blocks.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from backends.torch.attention import (
    available_backends,
    backend_names,
    create_backend,
    resolve_name,
)
from backends.torch.attention.base import AttentionSpec
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.inputs import prepare_inputs
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from schedulers.batch import Batch
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

CPU = torch.device("cpu")
BACKENDS = available_backends(CPU)
BLOCK = 4
NUM_BLOCKS = 160
# (new tokens, context before them): fresh prefills, a chunk over a cached context, decodes
FEW_DECODES = [(7, 0), (1, 0), (5, 6), (1, 3), (1, 12), (1, 15), (1, 16), (3, 0), (1, 29)]
# enough decodes for inductor_paged's compiled kernel (MIN_PAGED_DECODES) to run them
MANY_DECODES = FEW_DECODES + [(1, c) for c in (1, 2, 4, 5, 7, 8, 11, 20, 23, 31, 33, 40)]


def make_batch(rng: random.Random, schedule: list[tuple[int, int]]) -> Batch:
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    batch = Batch(0)
    for i, (new, cached) in enumerate(schedule):
        seq = Sequence(i, f"r{i}", [1] * (new + cached), SamplingParams(max_tokens=4))
        seq.num_computed_tokens = cached
        seq.block_table = [free.pop() for _ in range(-(-(new + cached) // BLOCK))]
        batch.add(seq, new)
    return batch


def reference(
    q: torch.Tensor,
    k_ctx: list[torch.Tensor],
    v_ctx: list[torch.Tensor],
    spec: AttentionSpec,
    schedule: list[tuple[int, int]],
) -> torch.Tensor:
    """(N, nh, hd) from the definition; k_ctx[i]/v_ctx[i] are sequence i's (C, nkv, hd)."""
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for i, (new, cached) in enumerate(schedule):
        for t in range(new):
            pos = cached + t
            for h in range(spec.num_heads):
                keys = k_ctx[i][: pos + 1, h // spec.group_size].double()  # (pos + 1, hd)
                values = v_ctx[i][: pos + 1, h // spec.group_size].double()
                scores = keys @ q[row + t, h].double() * spec.scale
                if spec.sliding_window is not None:
                    scores[: max(0, pos + 1 - spec.sliding_window)] = -math.inf
                out[row + t, h] = scores.softmax(0) @ values
        row += new
    return out


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("schedule", [FEW_DECODES, MANY_DECODES], ids=["few", "many"])
def test_every_backend_attends_like_softmax_over_the_logical_context(
    name: str, window: int | None, dtype: torch.dtype, schedule: list[tuple[int, int]]
) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=16, scale=0.3, sliding_window=window)
    cache = KVCache(KVLayout(1, spec.num_kv_heads, spec.head_dim, BLOCK, dtype), NUM_BLOCKS, CPU)
    cache.k[0].normal_()
    cache.v[0].normal_()
    batch = make_batch(rng, schedule)
    layout = prepare_inputs(batch, BLOCK, CPU).layout
    n = layout.num_tokens
    q = torch.randn(n, spec.num_heads, spec.head_dim).to(dtype)
    k = torch.randn(n, spec.num_kv_heads, spec.head_dim).to(dtype)
    v = torch.randn(n, spec.num_kv_heads, spec.head_dim).to(dtype)
    backend = create_backend(name, cache, [spec], CPU)
    backend.warm_up()
    meta = backend.build_metadata(layout)
    backend.write_kv(0, k, v, meta)
    out = backend.attend(0, q, k, v, meta)

    slots = cache.k[0].view(-1, spec.num_kv_heads, spec.head_dim)
    values = cache.v[0].view(-1, spec.num_kv_heads, spec.head_dim)
    k_ctx, v_ctx = [], []
    for seq, (new, cached) in zip(batch.seqs, schedule, strict=True):
        ids = torch.tensor([seq.block_table[p // BLOCK] * BLOCK + p % BLOCK
                            for p in range(new + cached)])  # fmt: skip
        k_ctx.append(slots[ids])
        v_ctx.append(values[ids])
    want = reference(q, k_ctx, v_ctx, spec, schedule)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif("inductor_paged" not in BACKENDS, reason="no C++ compiler for Inductor")
@pytest.mark.parametrize("compile", [False, True], ids=["paged-kernel", "paged-and-layer"])
def test_nothing_compiles_on_a_request_path_after_start_up(
    compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends.torch.attention import inductor_paged

    monkeypatch.setattr(inductor_paged, "MIN_PAGED_DECODES", 1)
    backend = TorchBackend(
        tiny_model("qwen2"), tiny_tokenizer(), device="cpu", block_size=BLOCK,
        max_model_len=128, attention_backend="inductor_paged", compile=compile,
    )  # fmt: skip
    assert backend.model.compiled == compile
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(3)
    for num_seqs, prompt in [(1, 1), (1, 9), (2, 3), (5, 17), (11, 40), (3, 2)]:
        seqs = [Sequence(i, f"r{i}", [rng.randrange(256) for _ in range(prompt)],
                         SamplingParams(max_tokens=8)) for i in range(num_seqs)]  # fmt: skip
        free = list(range(backend.kv_cache_spec.num_blocks))
        for seq in seqs:
            seq.block_table = [free.pop() for _ in range(-(-(prompt + 3) // BLOCK))]
        for step in range(3):
            batch = Batch(step)
            for seq in seqs:
                batch.add(seq, prompt if step == 0 else 1)
            backend.execute(batch)
            for seq in seqs:
                seq.num_computed_tokens += prompt if step == 0 else 1
                seq.output_token_ids.append(1)
    assert counters["stats"]["unique_graphs"] == graphs


def test_names_resolve_or_fail_with_the_choices() -> None:
    assert resolve_name("sdpa", CPU) == "sdpa"
    assert resolve_name("auto", CPU) in BACKENDS
    assert set(BACKENDS) <= set(backend_names())
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*auto, sdpa"):
        resolve_name("flash", CPU)
    with pytest.raises(ValueError, match="runs on cpu, not cuda"):
        resolve_name("inductor_paged", torch.device("cuda"))


def test_backends_are_imported_only_when_chosen() -> None:
    code = (
        "import sys, torch\n"
        "from backends.torch.attention import create_backend\n"
        "from backends.torch.attention.base import AttentionSpec\n"
        "from backends.torch.kv_cache import KVCache, KVLayout\n"
        "cache = KVCache(KVLayout(1, 1, 8, 4, torch.float32), 4, torch.device('cpu'))\n"
        "create_backend('sdpa', cache, [AttentionSpec(1, 1, 8, 1.0, None)], cache.k[0].device)\n"
        "print(sorted(m for m in sys.modules if m.startswith('backends.torch.attention.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = out.stdout.strip()
    assert imported == "['backends.torch.attention.base', 'backends.torch.attention.sdpa']"
