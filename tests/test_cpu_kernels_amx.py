"""bf16 linears by AMX tiles (csrc/amx.h) compute the matrix product across their blocks of
rows, share the threads with oneDNN's own AMX kernels, and stay off where they are turned off.

They run only where the CPU has AMX (Sapphire Rapids and later) and the OS grants the tile
state; elsewhere these tests skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch import cpu_kernels
from tests.test_cpu_kernels import KERNELS, reference_linear

REPO = Path(__file__).resolve().parents[1]
needs_amx = pytest.mark.skipif(
    KERNELS is None or not KERNELS.amx_built(), reason="no AMX tiles on this CPU or build"
)


def amx_from_row(rows: int) -> AbstractContextManager[None]:
    assert KERNELS is not None
    return cpu_kernels.amx_from_row(KERNELS, rows)


def both_paths(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(AMX's, AVX512-BF16's) linear of the same operands."""
    assert KERNELS is not None
    with amx_from_row(1):
        amx = KERNELS.linear(x, packed, n, bias)
    with amx_from_row(cpu_kernels.AMX_OFF):
        avx = KERNELS.linear(x, packed, n, bias)
    return amx, avx


@needs_amx
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 140),  # one block, two, a pass and a part (32 rows a pass)
    out_features=st.integers(1, 200),
    k_steps=st.integers(1, 8),  # K in steps of 32, the only K that takes the tiles
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_amx_linear_is_the_matrix_product_at_every_row_count(
    rows: int, out_features: int, k_steps: int, with_bias: bool, seed: int
) -> None:
    assert KERNELS is not None
    with amx_from_row(1):
        amx_products(rows, out_features, 32 * k_steps, with_bias, seed)


def amx_products(rows: int, out_features: int, k: int, with_bias: bool, seed: int) -> None:
    assert KERNELS is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(out_features, k, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen) if with_bias else None
    got = KERNELS.linear(x, cpu_kernels.pack_weight(w), out_features,
                         cpu_kernels.pack_bias(b, out_features))  # fmt: skip
    want = reference_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    scale = want.abs().max().item() + 1e-6
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale).all()
    # gate/up: the same tiles and epilogue as the two projections and silu_mul
    up = torch.randn(out_features, k, generator=gen).bfloat16()
    fused = KERNELS.linear_silu_mul(x, cpu_kernels.pack_gate_up(w, up), out_features)
    g = KERNELS.linear(x, cpu_kernels.pack_weight(w), out_features)
    u = KERNELS.linear(x, cpu_kernels.pack_weight(up), out_features)
    assert torch.equal(fused, KERNELS.silu_mul(g, u))


@needs_amx
def test_the_switch_chooses_between_two_computations_of_one_product() -> None:
    """Both paths round an fp32 sum once, but add the pairs of K in their own order: over
    many outputs a few differ by one bf16 step, so the switch is seen to change the kernel."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1536, generator=gen).bfloat16()
    w = torch.randn(512, 1536, generator=gen).bfloat16()
    amx, avx = both_paths(x, cpu_kernels.pack_weight(w), 512, None)
    differ = amx != avx
    assert 0 < differ.float().mean().item() < 0.01
    step = 2.0 ** (torch.floor(torch.log2(avx.float().abs())) - 7)  # one bf16 ulp
    assert ((amx.float() - avx.float()).abs()[differ] <= step[differ]).all()


AMX_WITH_ONEDNN = """
import torch
from backends.torch import cpu_kernels as ck
k = ck.native()
assert k.amx_built() and k.set_amx_min_rows(1) == 1
x, w = torch.randn(40, 576).bfloat16(), torch.randn(300, 576).bfloat16()
packed = ck.pack_weight(w)
want = k.linear(x, packed, 300)
a = torch.randn(512, 512).bfloat16()
for _ in range(50):
    a @ a  # oneDNN's bf16 matmul: its own AMX configuration on the same threads
    assert torch.equal(k.linear(x, packed, 300), want)
print("ok")
"""


@needs_amx
def test_amx_tiles_follow_onednns_on_the_same_threads() -> None:
    """A thread whose tiles oneDNN configured (or released) last must not fault in ours."""
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.AMX_SWITCH}
    done = subprocess.run([sys.executable, "-c", AMX_WITH_ONEDNN], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@needs_amx
def test_carousel_amx_0_keeps_the_avx512_path() -> None:
    script = "from backends.torch import cpu_kernels as ck; print(ck.native().set_amx_min_rows(1))"
    env = {**os.environ, cpu_kernels.AMX_SWITCH: "0"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == cpu_kernels.AMX_OFF
    assert "amx=False" in done.stdout + done.stderr
