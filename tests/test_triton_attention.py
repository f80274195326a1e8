"""The Triton paged attention backend, run on the CPU in Triton's interpreter.

Triton picks compiled or interpreted when a kernel is decorated, its own library included, so
the kernel tests run in a fresh process with `TRITON_INTERPRET=1` (`test_in_the_interpreter`
starts it on this file); in any other process they skip, and no other test file sees
`triton_paged` on the CPU.

The kernels are checked against a float64 reference written from the definition, over the
shapes a fast path gets wrong: GQA groups 1, 3 and 4, head dims 16 to 128 (a non power of
two among them), sliding windows narrower and wider than a key tile, a context of one token,
contexts ending exactly on a block or tile boundary, long prefills over several query
blocks, and prefills, prefill chunks over a cached context and decodes in one launch. Every
cache slot outside the sequences' contexts holds NaN, so a kernel that reads anything it
should not (past a context, another sequence's block, a padded block-table entry) fails.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from backends.torch import kernels
from backends.torch.attention import available_backends, create_backend, resolve_name
from backends.torch.attention.base import AttentionSpec
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.runner.inputs import prepare_inputs
from backends.torch.testing.tiny_models import tiny_model
from schedulers.base import SchedulerConfig
from tests.attention_fixture import EnginePath
from tests.test_attention import make_batch
from tests.test_oracle import MAX_TOKENS, hf_greedy, make_backend, prompts, run_engine

pytest.importorskip("triton")

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


#: this process runs the kernels in Triton's interpreter (set before triton was imported)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess of test_in_the_interpreter"
)


def run_interpreted(*args: str) -> None:
    """pytest `args` in a subprocess with TRITON_INTERPRET=1; all selected tests must pass.

    NOTE: Triton decorates its own library functions (`tl.zeros`, `tl.cdiv`, ...) for the
    interpreter or the GPU when it is imported, and this process imported it long ago; only a
    fresh process can interpret.
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_in_the_interpreter() -> None:
    run_interpreted(str(Path(__file__).relative_to(ROOT)), "-m", "not slow")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_slow_in_the_interpreter() -> None:
    run_interpreted(str(Path(__file__).relative_to(ROOT)), "-m", "slow")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 163 s for four architectures on the 2-core CI machine
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_oracle_suite_in_the_interpreter() -> None:
    """The oracle suite's every engine path test, through `triton_paged`, on the tiny models
    whose attention differs: Mistral's (a sliding window) and Qwen3's (none).

    The tiny architectures give the attention backend the same head size and heads; what else
    tells them apart (Llama 3's rope scaling, Qwen2's biases, Qwen3's q/k norms) happens before
    attention, where the oracle's other backends check it, so each further architecture ran the
    interpreter's kernels over the same shapes again (163 s of a 2-core CI run for all four).
    Qwen2 under orca: `test_fp32_greedy_through_triton_paged_equals_hf_generate` above, run by
    `test_in_the_interpreter`.
    """
    selected = "triton_paged and (mistral or qwen3)"
    run_interpreted("tests/test_oracle.py", "-k", selected, "-m", "not real_model")


@pytest.fixture(name="interpreter")
def interpreter_fixture() -> ModuleType:
    """Carousel's Triton kernels, as Triton's interpreter runs them."""
    package = kernels.triton("cpu")
    assert package.interpreted()
    return package


@dataclass(frozen=True)
class Case:
    """One launch: a GQA geometry, a window, a cache, and (new tokens, cached before) per seq."""

    num_kv_heads: int
    group: int
    head_dim: int
    window: int | None
    block_size: int
    schedule: tuple[tuple[int, int], ...]
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"g{self.group}-hd{self.head_dim}-w{self.window}-bs{self.block_size}-{dtype}-"
                f"{len(self.schedule)}seqs")  # fmt: skip


MIXED = ((7, 0), (1, 0), (5, 6), (1, 3), (1, 12), (1, 15), (1, 16), (3, 0), (1, 29))
CASES = [
    # prefills, a chunk over a cached context, decodes of every length around the blocks
    Case(2, 1, 16, None, 4, MIXED),
    Case(2, 3, 24, 5, 4, MIXED),  # group 3: 5 tokens of 3 heads in 16 rows; hd 24 pads to 32
    Case(1, 4, 128, None, 16, ((1, 15), (1, 31), (1, 63), (1, 0), (1, 32))),  # exact boundaries
    Case(2, 4, 64, 7, 16, ((40, 0), (1, 70), (9, 33))),  # 40 tokens: 3 query blocks of 16
    Case(1, 1, 32, 40, 8, ((1, 99), (70, 30), (1, 0))),  # a window wider than a key tile
    Case(1, 3, 48, None, 4, ((33, 0), (1, 1), (2, 63))),  # 33 = 5 blocks of 7 tokens, 2 left
    Case(2, 3, 16, 3, 4, MIXED, torch.bfloat16),
    Case(1, 4, 80, None, 16, ((17, 16), (1, 47)), torch.float16),
]


def paged_context(
    case: Case, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], torch.Tensor]:
    """NaN caches, scattered block tables padded with a NaN block, the slots of each context.

    Returns the caches, each sequence's context slots, and (B, max_blocks) block tables.
    """
    bs = case.block_size
    widths = [-(-(new + cached) // bs) for new, cached in case.schedule]
    free = list(range(1, sum(widths) + 8))  # block 0 is the padding: NaN forever
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(w)] for w in widths]
    shape = (len(free) + sum(widths) + 1, bs, case.num_kv_heads, case.head_dim)
    k_cache = torch.full(shape, math.nan, dtype=case.dtype)
    v_cache = torch.full(shape, math.nan, dtype=case.dtype)
    slots = [
        [table[p // bs] * bs + p % bs for p in range(new + cached)]
        for table, (new, cached) in zip(tables, case.schedule, strict=True)
    ]
    padded = torch.tensor([t + [0] * (max(widths) - len(t)) for t in tables])
    return k_cache, v_cache, slots, padded


def reference(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    case: Case,
    scale: float,
) -> torch.Tensor:
    """(N, nh, hd) in float64 from the definition; keys[i], values[i] are (C, nkv, hd)."""
    out, row = [], 0
    for (new, cached), k, v in zip(case.schedule, keys, values, strict=True):
        k = k.double().repeat_interleave(case.group, dim=1).transpose(0, 1)  # (nh, C, hd)
        v = v.double().repeat_interleave(case.group, dim=1).transpose(0, 1)
        queries = q[row : row + new].double().transpose(0, 1)  # (nh, L, hd)
        scores = queries @ k.transpose(1, 2) * scale  # (nh, L, C)
        q_pos = torch.arange(cached, cached + new)[:, None]  # (L, 1)
        k_pos = torch.arange(cached + new)[None, :]  # (1, C)
        allowed = k_pos <= q_pos
        if case.window is not None:
            allowed &= k_pos > q_pos - case.window
        scores = scores.masked_fill(~allowed, -math.inf)
        out.append((scores.softmax(-1) @ v).transpose(0, 1))  # (L, nh, hd)
        row += new
    return torch.cat(out)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


@interpreted_only
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_store_and_attend_like_softmax_over_each_paged_context(
    interpreter: ModuleType, case: Case
) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    nkv, hd = case.num_kv_heads, case.head_dim
    nh = nkv * case.group
    k_cache, v_cache, slots, block_tables = paged_context(case, rng)
    keys = [torch.randn(len(s), nkv, hd).to(case.dtype) for s in slots]
    values = [torch.randn(len(s), nkv, hd).to(case.dtype) for s in slots]
    for s, k, v, (new, _) in zip(slots, keys, values, case.schedule, strict=True):
        cached = len(s) - new  # what earlier steps stored
        k_cache.view(-1, nkv, hd)[s[:cached]] = k[:cached]
        v_cache.view(-1, nkv, hd)[s[:cached]] = v[:cached]
    # this step's rows, as the model hands them over: strided views of one fused projection
    num_tokens = sum(new for new, _ in case.schedule)
    qkv = torch.randn(num_tokens, (nh + 2 * nkv) * hd).to(case.dtype)
    q = qkv[:, : nh * hd].view(num_tokens, nh, hd)
    k_new = qkv[:, nh * hd : (nh + nkv) * hd].view(num_tokens, nkv, hd)
    v_new = qkv[:, (nh + nkv) * hd :].view(num_tokens, nkv, hd)
    news = [new for new, _ in case.schedule]
    k_new.copy_(torch.cat([k[len(k) - new :] for k, new in zip(keys, news, strict=True)]))
    v_new.copy_(torch.cat([v[len(v) - new :] for v, new in zip(values, news, strict=True)]))
    slot_mapping = torch.tensor([x for s, new in zip(slots, news, strict=True) for x in s[-new:]])
    cu_seqlens_q = torch.tensor([0, *torch.tensor([n for n, _ in case.schedule]).cumsum(0)])
    seq_lens = torch.tensor([len(s) for s in slots])

    interpreter.store_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    out = torch.full((num_tokens, nh, hd), math.nan, dtype=case.dtype)
    scale = hd**-0.5
    interpreter.paged_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, case.window,
        max(new for new, _ in case.schedule),
    )  # fmt: skip

    for s, k, v in zip(slots, keys, values, strict=True):  # every context now fully stored
        assert torch.equal(k_cache.view(-1, nkv, hd)[s], k)
        assert torch.equal(v_cache.view(-1, nkv, hd)[s], v)
    want = reference(q, keys, values, case, scale)
    tol = tolerance(case.dtype)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@interpreted_only
def test_store_kv_skips_a_padded_row(interpreter: ModuleType) -> None:
    """A negative slot (a padded row of a CUDA-graph bucket) writes nothing."""
    k_cache = torch.zeros(4, 4, 2, 16)
    v_cache = torch.zeros(4, 4, 2, 16)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    interpreter.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[1, 1], v[0])
    k_cache[1, 1] = 0
    v_cache[1, 1] = 0
    assert not k_cache.any() and not v_cache.any()


@interpreted_only
@pytest.mark.parametrize("window", [None, 5])
def test_backend_attends_a_scheduled_batch_through_the_registry(window: int | None) -> None:
    """`triton_paged` by name, on a layout from `prepare_inputs`, matches the reference."""
    rng = random.Random(1)
    torch.manual_seed(1)
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=16, scale=0.3, sliding_window=window)
    schedule = list(MIXED)
    cache = KVCache(KVLayout(1, 2, 16, 4, torch.float32), 160, CPU)
    cache.k[0].normal_()
    cache.v[0].normal_()
    batch = make_batch(rng, schedule)
    layout = prepare_inputs(batch, 4, CPU).layout
    n = layout.num_tokens
    q, k, v = torch.randn(n, 6, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    backend = create_backend("triton_paged", cache, [spec], CPU)
    meta = backend.build_metadata(layout)
    backend.write_kv(0, k, v, meta)
    out = backend.attend(0, q, k, v, meta)

    keys, values = [], []
    for seq, (new, cached) in zip(batch.seqs, schedule, strict=True):
        ids = [seq.block_table[p // 4] * 4 + p % 4 for p in range(new + cached)]
        keys.append(cache.k[0].view(-1, 2, 16)[ids])
        values.append(cache.v[0].view(-1, 2, 16)[ids])
    case = Case(2, 3, 16, window, 4, tuple(schedule))
    want = reference(q, keys, values, case, 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_registry_offers_triton_paged_on_the_cpu_only_in_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "triton_paged" in available_backends(CPU)
    assert resolve_name("auto", CPU, torch.float32, native=False) == "sdpa"  # never the default
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "triton_paged" not in available_backends(CPU)
    with pytest.raises(ValueError, match="only in Triton's interpreter"):
        resolve_name("triton_paged", CPU)


def test_auto_is_triton_paged_on_cuda() -> None:
    cuda = torch.device("cuda")
    assert resolve_name("auto", cuda, torch.bfloat16) == "triton_paged"
    assert resolve_name("auto", cuda, torch.float8_e4m3fn) == "sdpa"  # not a dtype it runs


@interpreted_only
def test_fp32_greedy_through_triton_paged_equals_hf_generate() -> None:
    """The oracle: orca's mixed batches through the kernels give HF's tokens exactly.

    qwen2's tiny model has a full-attention layer and a sliding-window one; every tiny
    architecture, under every policy, runs in `test_oracle_suite_in_the_interpreter`.
    """
    model = tiny_model("qwen2")
    model.generation_config.eos_token_id = None
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    backend = make_backend(model, EnginePath("triton_paged", compile=False))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    outputs, llm = run_engine(backend, "orca", config)
    assert outputs == expected
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in engine.trace)


def test_gpu_check_attention_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    from scripts import gpu_check_attention

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script runs for real")
    out = tmp_path / "attention.json"
    assert gpu_check_attention.main(out) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == "no CUDA device"


@pytest.mark.slow
@interpreted_only
def test_gpu_check_attention_runs_its_checks_in_the_interpreter() -> None:
    """The script's GPU path, small, on the CPU: its reference agrees and its rows are there."""
    from scripts import gpu_check_attention as script

    cases: list[script.Case] = [
        (2, 3, 16, None, 4, [(5, 0), (1, 6), (1, 0)], "float32"),
        (1, 4, 32, 3, 4, [(1, 9), (6, 2)], "bfloat16"),
    ]
    result = script.run(CPU, batch_sizes=(2,), long=40, repeats=1, cases=cases)
    assert result["ok"], result["correctness"]
    assert [r["batch"] for r in result["decode"]] == [2, 2]
    assert all(
        r["triton_paged_with_40_us"] > 0 and r["sdpa_short_us"] > 0 for r in result["decode"]
    )
