"""The AVX2 build of Carousel's CPU kernels computes what torch does, on any CPU with AVX2.

A file of its own: its build (the whole of csrc/ again, for AVX2) starts in the background
when the session does (tests/background_builds.py), so by the time this file runs, last
among the files as xdist orders them, the kernels are usually built and the test only imports
and checks them; else its process waits on the build's lock for the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.torch import cpu_kernels

AVX2_CHECK = """
import torch, torch.nn.functional as F
from backends.torch import cpu_kernels as ck
k = ck.native()
assert k is not None and ck.isa() == "avx2", ck.why_off()
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2**-6)):
    for rows in (1, 7, 33):
        w, b = torch.randn(150, 98, dtype=dtype), torch.randn(150)
        x = torch.randn(rows, 98, dtype=dtype)
        got = k.linear(x, ck.pack_weight(w), 150, ck.pack_bias(b, 150))
        want = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 10)
        g, u = torch.randn(70, 98, dtype=dtype), torch.randn(70, 98, dtype=dtype)
        got = k.linear_silu_mul(x, ck.pack_gate_up(g, u), 70)
        want = F.silu(F.linear(x.double(), g.double())) * F.linear(x.double(), u.double())
        torch.testing.assert_close(got.double(), want, rtol=tol * 4, atol=tol * 40)
# decode attention over scattered blocks against softmax(q k^T) v
nb, bs, nkv, hd, nh = 12, 4, 3, 64, 9
kc, vc = torch.randn(nb, bs, nkv, hd), torch.randn(nb, bs, nkv, hd)
tables = torch.tensor([[5, 2, 9, 0], [11, 3, 7, 1]])
lens = torch.tensor([13, 6])
q = torch.randn(2, nh, hd)
out = torch.empty_like(q)
k.decode_attention(q, kc, vc, tables, lens, hd**-0.5, -1, out)
for d in range(2):
    slots = [int(tables[d, t // bs]) * bs + t % bs for t in range(int(lens[d]))]
    keys = kc.view(-1, nkv, hd)[slots].repeat_interleave(nh // nkv, 1)
    vals = vc.view(-1, nkv, hd)[slots].repeat_interleave(nh // nkv, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[d], keys) * hd**-0.5, -1)
    torch.testing.assert_close(out[d], torch.einsum("ht,thd->hd", p, vals), rtol=1e-4, atol=1e-5)
h, wn = torch.randn(5, 100), torch.randn(100)
want = wn * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
torch.testing.assert_close(k.rms_norm(h, wn, 1e-6), want, rtol=1e-5, atol=1e-5)
logits = torch.randn(3, 1001)
assert torch.equal(k.argmax(logits), logits.argmax(-1))
print("avx2 ok")
"""


def test_the_avx2_build_computes_what_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear, gate/up, attention, norm and argmax of the AVX2 build: the default on an
    AVX2-only CPU, asked for (`CAROUSEL_CPU_KERNELS=avx2`) on an AVX-512 one."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, cpu_kernels.AVX2_ONLY)
    if cpu_kernels.unavailable_reason() is not None:
        pytest.skip(f"no AVX2 build here: {cpu_kernels.unavailable_reason()}")
    env = {**os.environ, cpu_kernels.ENV_SWITCH: cpu_kernels.AVX2_ONLY}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK], env=env, cwd=root, timeout=900,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "avx2 ok" in done.stdout, done.stderr[-3000:]
