"""Carousel's CPU kernels compute what their definitions say, at every shape, or stay off.

`linear` is checked against the float64 product (bf16: rounded once, as the kernel rounds
its fp32 sum), `decode_attention` against softmax attention written from the definition
over the logical context (scattered blocks, windows, GQA groups, head sizes that are not a
multiple of the 16-lane vectors, few and many sequences: the two task splits).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch import cpu_kernels
from backends.torch.attention import create_backend
from backends.torch.attention.base import AttentionSpec
from backends.torch.kv_cache import KVCache, KVLayout

KERNELS = cpu_kernels.native()
needs_kernels = pytest.mark.skipif(
    KERNELS is None, reason=f"no CPU kernels here: {cpu_kernels.unavailable_reason()}"
)
DTYPES = [torch.float32, torch.bfloat16]


def test_the_kernels_build_wherever_nothing_rules_them_out() -> None:
    """A failed build falls back to torch's kernels in a server; here it must not pass
    unseen (every other test in this file would only be skipped)."""
    if cpu_kernels.unavailable_reason() is None:
        assert KERNELS is not None, "the CPU kernels failed to build (see the log above)"


@pytest.mark.slow
def test_the_wheel_ships_every_file_the_build_reads(tmp_path: Path) -> None:
    """`pip install .` (the Docker image's install) gets every source and header: a missing
    one fails the build (or, before, its digest), and a server falls back to torch's kernels."""
    # from a copy: setuptools' build/ in the tree would keep files the package data lacks
    source = tmp_path / "source"
    shutil.copytree(
        Path(__file__).resolve().parents[1], source,
        ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "bench-results"),
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    csrc = "backends/torch/cpu_kernels/csrc/"
    missing = [n for n in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS) if csrc + n not in shipped]
    assert not missing, f"the wheel lacks {missing}"
    tests = sorted(n for n in shipped if n.startswith("tests/"))
    assert not tests, f"the wheel ships the tests package: {tests[:3]}"


NO_COMPILER = "no C++ compiler (c++ or g++) on PATH"


def test_the_build_takes_the_best_instruction_set_the_cpu_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AVX-512 (BF16) with AMX, then without, else AVX2 with FMA and F16C, else nothing."""
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    avx2 = {"avx", "avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    amx = avx512 | {"amx_tile", "amx_bf16"}
    cases = [(amx, "avx512_amx", "-mamx-bf16"), (avx512, "avx512", "-mavx512bf16"),
             (avx2, "avx2", "-mavx2")]  # fmt: skip
    for flags, isa, flag in cases:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: set(flags))
        assert cpu_kernels.isa() == isa
        assert flag in cpu_kernels.build_flags()
        if sys.platform == "linux":
            assert cpu_kernels.unavailable_reason() in (None, NO_COMPILER)
    # the switch turns any build off, or asks for the AVX2 one on any CPU that can run it
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.unavailable_reason() == f"{cpu_kernels.ENV_SWITCH}=0"
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, cpu_kernels.AVX2_ONLY)
    for flags in (amx, avx512, avx2):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: set(flags))
        assert cpu_kernels.isa() == "avx2"
        assert "-mavx512f" not in cpu_kernels.build_flags()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: avx2 - {"fma"})
    assert cpu_kernels.isa() is None
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
    # AVX-512 without BF16 is built as AVX2; without F16C, nothing
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: amx - {"avx512_bf16"})
    assert cpu_kernels.isa() == "avx2"
    assert "-mamx-tile" not in cpu_kernels.build_flags()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: avx2 - {"f16c"})
    assert cpu_kernels.isa() is None
    assert cpu_kernels.unavailable_reason() == "this CPU lacks f16c"
    # the three builds never share a cache entry
    digests = set()
    for flags in (amx, avx512, avx2):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: set(flags))
        digests.add(cpu_kernels._digest())
    assert len(digests) == 3


def reference_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 140),
    out_features=st.integers(1, 200),
    half_k=st.integers(1, 100),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_is_the_matrix_product_at_every_shape(
    rows: int, out_features: int, half_k: int, dtype: torch.dtype, with_bias: bool, seed: int
) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    k = 2 * half_k - (dtype == torch.float32 and seed % 2)  # fp32 takes odd K too
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(out_features, k, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    got = KERNELS.linear(x, cpu_kernels.pack_weight(w), out_features,
                         cpu_kernels.pack_bias(b, out_features))  # fmt: skip
    want = reference_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # fp32: summation order only; bf16: exact products, an fp32 sum, one rounding to bf16
    scale = want.abs().max().item() + 1e-6
    tolerance = 1e-5 * scale if dtype == torch.float32 else 2**-8 * want.abs() + 1e-5 * scale
    assert ((got.double() - want).abs() <= tolerance).all()


@needs_kernels
@pytest.mark.parametrize(("own_lines", "chunked"), [(True, True), (False, False)],
                         ids=["intel-plan", "amd-plan"])  # fmt: skip
@pytest.mark.parametrize("rows", [7, 8, 13, 32, 33])
def test_fp32_rows_that_share_a_tile_get_the_bits_each_row_gets_alone_under_either_plan(
    rows: int, own_lines: bool, chunked: bool
) -> None:
    """Under Intel's plan 7 to 32 fp32 rows take a tile in 16 KB chunks of K, their sums
    carried between chunks; under AMD's, whole passes (linear.cpp `stream_plan`). Either way
    each row's sums must come out as that row alone computes them."""
    assert KERNELS is not None
    with cpu_kernels.stream_plan(KERNELS, own_lines=own_lines, chunked=chunked):
        gen = torch.Generator().manual_seed(rows)
        k = 64 * 9 + 5  # nine chunks and a remainder
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn(200, k, generator=gen)
        bias = cpu_kernels.pack_bias(torch.randn(200, generator=gen), 200)
        packed, gate_up = cpu_kernels.pack_weight(w), cpu_kernels.pack_gate_up(w[:100], w[100:])
        got = KERNELS.linear(x, packed, 200, bias)
        alone = torch.cat([KERNELS.linear(x[i : i + 1], packed, 200, bias) for i in range(rows)])
        assert torch.equal(got, alone)
        got = KERNELS.linear_silu_mul(x, gate_up, 100)
        alone = torch.cat(
            [KERNELS.linear_silu_mul(x[i : i + 1], gate_up, 100) for i in range(rows)]
        )
        assert torch.equal(got, alone)
        assert torch.allclose(got, F.silu(x @ w[:100].T) * (x @ w[100:].T), rtol=1e-4, atol=1e-3)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 140),
    intermediate=st.integers(1, 120),
    half_k=st.integers(1, 60),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_linear_silu_mul_is_both_projections_then_silu_mul_bit_for_bit(
    rows: int, intermediate: int, half_k: int, dtype: torch.dtype, seed: int
) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    k = 2 * half_k - (dtype == torch.float32 and seed % 2)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    gate = torch.randn(intermediate, k, generator=gen).to(dtype)
    up = torch.randn(intermediate, k, generator=gen).to(dtype)
    got = KERNELS.linear_silu_mul(x, cpu_kernels.pack_gate_up(gate, up), intermediate)
    g = KERNELS.linear(x, cpu_kernels.pack_weight(gate), intermediate)
    u = KERNELS.linear(x, cpu_kernels.pack_weight(up), intermediate)
    assert got.dtype == dtype and got.shape == (rows, intermediate)
    assert torch.equal(got, KERNELS.silu_mul(g, u))  # what the unfused layer computes
    want = F.silu(reference_linear(x, gate, None)) * reference_linear(x, up, None)
    scale = want.abs().max().item() + 1e-6
    tolerance = 1e-4 * scale if dtype == torch.float32 else 2**-6 * want.abs() + 1e-2 * scale
    assert ((got.double() - want).abs() <= tolerance).all()


@needs_kernels
def test_linear_silu_mul_rejects_what_it_cannot_compute() -> None:
    assert KERNELS is not None
    packed = cpu_kernels.pack_gate_up(torch.randn(40, 32), torch.randn(40, 32))  # 2 tiles
    with pytest.raises(RuntimeError, match="disagree on K"):
        KERNELS.linear_silu_mul(torch.randn(2, 16), packed, 40)
    with pytest.raises(RuntimeError, match="more out_features"):
        KERNELS.linear_silu_mul(torch.randn(2, 32), packed, 65)
    with pytest.raises(ValueError, match="one shape and dtype"):
        cpu_kernels.pack_gate_up(torch.randn(40, 32), torch.randn(41, 32))


@needs_kernels
def test_linear_rejects_what_it_cannot_compute() -> None:
    assert KERNELS is not None
    w = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match="disagree on K"):
        KERNELS.linear(torch.randn(2, 16), cpu_kernels.pack_weight(w), 64, None)
    with pytest.raises(RuntimeError, match="packed weight"):
        KERNELS.linear(torch.randn(2, 32).bfloat16(), cpu_kernels.pack_weight(w), 64, None)
    with pytest.raises(RuntimeError, match="padded to whole tiles"):
        KERNELS.linear(torch.randn(2, 32), cpu_kernels.pack_weight(w), 64, torch.randn(7))
    with pytest.raises(ValueError, match="even number"):
        cpu_kernels.pack_weight(torch.randn(4, 3).bfloat16())
    assert not cpu_kernels.packable(torch.randn(4, 3).bfloat16())
    assert not cpu_kernels.packable(torch.randn(4, 4).half())


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
    lens: torch.Tensor, scale: float, window: int,
) -> torch.Tensor:  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    out = torch.empty(q.shape, dtype=torch.float64)
    for d in range(num_seqs):
        ctx = int(lens[d])
        keys = k_cache[tables[d]].reshape(-1, num_kv, head_dim)[:ctx].double()
        values = v_cache[tables[d]].reshape(-1, num_kv, head_dim)[:ctx].double()
        for h in range(num_heads):
            scores = keys[:, h // group] @ q[d, h].double() * scale
            if window >= 0:
                scores[: max(0, ctx - window)] = -math.inf
            out[d, h] = scores.softmax(0) @ values[:, h // group]
    return out


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(
    num_seqs=st.integers(1, 9),
    num_kv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([8, 16, 24, 64, 80, 128, 136, 256]),
    block=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([-1, 1, 5, 40]),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_decode_attention_is_softmax_attention_over_the_logical_context(
    num_seqs: int, num_kv: int, group: int, head_dim: int, block: int, window: int,
    dtype: torch.dtype, data: st.DataObject,
) -> None:  # fmt: skip
    assert KERNELS is not None
    lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    width = max(-(-n // block) for n in lens)
    num_blocks = sum(-(-n // block) for n in lens) + 3
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shape = (num_blocks, block, num_kv, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)  # padded with block 0
    for d, n in enumerate(lens):
        for i in range(-(-n // block)):
            tables[d, i] = free.pop()
    q = torch.randn(num_seqs, num_kv * group, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    context = torch.tensor(lens, dtype=torch.int64)
    KERNELS.decode_attention(q, k_cache, v_cache, tables, context, scale, window, out)
    want = reference_attention(q, k_cache, v_cache, tables, context, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8 * want.abs() + 1e-4
    assert ((out.double() - want).abs() <= tolerance).all()


@needs_kernels
def test_decode_attention_rejects_mismatched_inputs() -> None:
    assert KERNELS is not None
    cache = torch.zeros(4, 4, 2, 16)
    q, tables, lens = torch.zeros(3, 4, 16), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3)
    with pytest.raises(RuntimeError, match="int64"):
        KERNELS.decode_attention(q, cache, cache, tables, lens, 1.0, -1, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="share a dtype"):
        KERNELS.decode_attention(q.bfloat16(), cache, cache, tables, lens.long(), 1.0, -1,
                                 torch.empty_like(q.bfloat16()))  # fmt: skip
    with pytest.raises(RuntimeError, match="head shapes"):
        KERNELS.decode_attention(torch.zeros(3, 3, 16), cache, cache, tables, lens.long(), 1.0,
                                 -1, torch.zeros(3, 3, 16))  # fmt: skip
    wide, wide_q = torch.zeros(4, 4, 2, 272), torch.zeros(3, 4, 272)
    with pytest.raises(RuntimeError, match="head sizes up to 256, not 272"):
        KERNELS.decode_attention(wide_q, wide, wide, tables, lens.long(), 1.0, -1,
                                 torch.empty_like(wide_q))  # fmt: skip


@needs_kernels
def test_heads_wider_than_the_kernel_take_sdpa() -> None:
    cache = KVCache(KVLayout(1, 1, 272, 4, torch.float32), 4, torch.device("cpu"))
    wide = [AttentionSpec(1, 1, 272, 1.0, None)]
    assert type(create_backend("auto", cache, wide, cache.k[0].device)).__name__ == "SDPABackend"
    with pytest.raises(ValueError, match="head sizes up to 256, not 272"):
        create_backend("cpu_paged", cache, wide, cache.k[0].device)


def test_switched_off_the_engine_keeps_torchs_kernels() -> None:
    """`CAROUSEL_CPU_KERNELS=0`: nothing is built, linears pack for oneDNN, `auto` is sdpa."""
    code = (
        "import torch\n"
        "from backends.torch import cpu_kernels\n"
        "from backends.torch.attention import available_backends, resolve_name\n"
        "from backends.torch.layers.linear import pack_plan\n"
        "cpu = torch.device('cpu')\n"
        "assert cpu_kernels.native() is None\n"
        "assert cpu_kernels.unavailable_reason() == 'CAROUSEL_CPU_KERNELS=0'\n"
        "assert 'cpu_paged' not in available_backends(cpu)\n"
        "assert resolve_name('auto', cpu, torch.bfloat16) == 'sdpa'\n"
        "plan = pack_plan(cpu, torch.bfloat16)\n"
        "assert plan is None or plan.kernel == 'onednn', plan\n"
        "try:\n"
        "    resolve_name('cpu_paged', cpu)\n"
        "except ValueError as exc:\n"
        "    assert 'CAROUSEL_CPU_KERNELS=0' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('cpu_paged resolved without its kernels')\n"
    )
    env = {**os.environ, cpu_kernels.ENV_SWITCH: "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@needs_kernels
def test_auto_takes_the_cpu_kernels_where_they_run() -> None:
    from backends.torch.attention import resolve_name
    from backends.torch.layers.linear import NATIVE, pack_plan

    cpu = torch.device("cpu")
    assert resolve_name("auto", cpu, torch.bfloat16) == "cpu_paged"
    assert resolve_name("auto", cpu, torch.float16) == "sdpa"
    for dtype in DTYPES:
        plan = pack_plan(cpu, dtype)
        assert plan is not None and plan.kernel == NATIVE


@needs_kernels
def test_cpu_kernels_false_keeps_torchs_kernels_in_one_backend() -> None:
    from backends.torch.layers.linear import NATIVE
    from backends.torch.runner.backend import TorchBackend
    from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer

    def build(**kwargs: bool) -> TorchBackend:
        return TorchBackend(
            tiny_model("llama"), tiny_tokenizer(), device="cpu", dtype="bfloat16",
            kv_cache_gb=0.01, **kwargs,
        )  # fmt: skip

    ours, torchs = build(), build(cpu_kernels=False)
    assert ours.model.attention.name == "cpu_paged"
    assert ours.model.linears[0].qkv.plan.kernel == NATIVE
    assert torchs.model.attention.name == "sdpa"
    assert (
        torchs.model.linears[0].qkv.plan is None
        or torchs.model.linears[0].qkv.plan.kernel != NATIVE
    )


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bf16 spacing (want rounded to bf16 first)."""
    spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
    return (got.float() - want.float()).abs() / spacing


def assert_as_hf(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within fp32 sum-order noise; bf16: mostly bit-equal, never a bf16 step off."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    assert (bf16_ulps(got, want) <= 1.0).all()
    assert (got == want).float().mean() >= 0.99


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8, 64, 100, 576])
def test_norm_kernels_compute_what_hfs_modules_compute(dtype: torch.dtype, hidden: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert KERNELS is not None
    torch.manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    h, d = torch.randn(37, hidden).to(dtype) * 3, torch.randn(37, hidden).to(dtype)
    with torch.no_grad():
        assert_as_hf(KERNELS.rms_norm(h, norm.weight, 1e-5), norm(h))
        residual = h.clone()
        normed = KERNELS.add_rms_norm(residual, d, norm.weight, 1e-5)
        assert torch.equal(residual, h + d)  # the residual stream, updated in place
        assert_as_hf(normed, norm(h + d))
        gate, up = torch.randn(37, hidden).to(dtype) * 4, torch.randn(37, hidden).to(dtype)
        assert_as_hf(KERNELS.silu_mul(gate, up), F.silu(gate) * up)


@needs_kernels
def test_norm_kernels_reject_mismatched_inputs() -> None:
    assert KERNELS is not None
    h = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        KERNELS.rms_norm(h, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual delta"):
        KERNELS.add_rms_norm(h, torch.randn(4, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="up"):
        KERNELS.silu_mul(h, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        KERNELS.rms_norm(h.t(), torch.ones(4), 1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 40)])
def test_rotary_write_kv_is_hfs_rotary_and_a_cache_write(
    dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int
) -> None:
    from backends.torch.attention.rotary import rotate_half

    assert KERNELS is not None
    torch.manual_seed(head_dim)
    n, block = 11, 4
    qkv = torch.randn(n, (num_heads + 2 * num_kv) * head_dim).to(dtype)
    angles = torch.randn(n, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [torch.zeros(8, block, num_kv, head_dim, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(8 * block)[:n]
    qk = qkv[:, : (num_heads + num_kv) * head_dim].view(n, -1, head_dim)
    want = qk * cos[:, None] + rotate_half(qk) * sin[:, None]  # HF's formula, op by op
    v = qkv[:, (num_heads + num_kv) * head_dim :].clone().view(n, num_kv, head_dim)
    KERNELS.rotary_write_kv(qkv, cos, sin, caches[0], caches[1], slots, num_heads, num_kv)
    assert torch.equal(qk, want)  # rotated in place, bit for bit
    k_rows = caches[0].view(-1, num_kv, head_dim)[slots]
    assert torch.equal(k_rows, want[:, num_heads:])
    assert torch.equal(caches[1].view(-1, num_kv, head_dim)[slots], v)
    untouched = torch.ones(8 * block, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[0].view(8 * block, -1)[untouched] == 0).all()


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torchs_first_index_of_the_maximum(dtype: torch.dtype) -> None:
    assert KERNELS is not None
    torch.manual_seed(0)
    logits = torch.randn(9, 1003).to(dtype)
    logits[1] = 0.0  # all tied: the first index
    logits[2, [5, 700, 1002]] = 50.0  # ties across lanes and the tail
    logits[3] = -math.inf
    logits[4, 17] = math.nan
    logits[5, :] = torch.arange(1003).to(dtype)  # the last element, in the tail
    wide = torch.randn(9, 1100).to(dtype)
    wide[:, :1003] = logits
    for x in (logits, wide[:, :1003]):  # contiguous rows, and rows of a wider matrix
        assert torch.equal(KERNELS.argmax(x), x.argmax(dim=-1))


#: a module of a few lines in the kernels' bindings.cpp place (csrc/'s other sources empty): the
#: build driver compiles and locks it exactly as the kernels, in a second instead of minutes
STAND_IN = """#include <Python.h>
#define NAME_(x) #x
#define NAME(x) NAME_(x)
#define INIT_(x) PyInit_##x
#define INIT(x) INIT_(x)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1,
                             methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
"""
#: builds (or imports) the stand-in through `build_variant`, the kernels' own build driver
#: (`_built`: flock, torch's lock file, ninja); `import` forbids a compile
BUILD_STAND_IN = """
import sys
from pathlib import Path
from backends.torch import cpu_kernels
if sys.argv[2] == "import":
    cpu_kernels._compile = lambda *args: sys.exit("compiled again: the build was not reused")
assert cpu_kernels.build_variant(Path(sys.argv[1]), "carousel_stand_in").answer() == 42
"""


@needs_kernels
def test_a_build_killed_half_way_leaves_no_lock_behind(tmp_path: Path) -> None:
    """A server stopped while it compiles must not leave every later start waiting forever
    (torch's own lock file outlives its process; the flock around it does not).

    The lock handling does not depend on what is compiled: a stand-in module goes through
    the kernels' build driver, `native()`'s (which the session's build exercises in full)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in cpu_kernels.SOURCES:
        (csrc / name).write_text(STAND_IN if name == "bindings.cpp" else "")
    env = {**os.environ, "CAROUSEL_CACHE_DIR": str(tmp_path / "cache")}
    build_dirs = tmp_path / "cache" / "cpu_kernels"
    started: list[subprocess.Popen[bytes]] = []

    def build(mode: str) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(
            [sys.executable, "-c", BUILD_STAND_IN, str(csrc), mode], env=env,
            # a group of its own: killed with its compilers (as by Ctrl-C or a stopped
            # container), so that no orphan finishes the build behind the test's back
            start_new_session=True,
        ))  # fmt: skip
        return started[-1]

    try:
        first = build("build")
        deadline = time.monotonic() + 120
        while not list(build_dirs.glob("*/lock")):  # torch's lock: the build is under way
            assert time.monotonic() < deadline and first.poll() is None, "it never started"
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        assert list(build_dirs.glob("*/lock")), "the killed build left no lock file of torch's"
        assert not list(build_dirs.glob("*/*.so")), "the build finished before it was killed"
        assert build("build").wait(timeout=120) == 0  # it did not wait on the dead build's lock
        assert list(build_dirs.glob("*/carousel_stand_in.so"))
        # and a third process imports what the second one built, without building again
        assert build("import").wait(timeout=120) == 0
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
