"""Carousel's CPU kernels against torch's, one kernel at a time, as a decode step meets them.

    python scripts/kernel_bench.py [--rows 1,8,32,64] [--dtypes bfloat16,float32] [--repeats 5]

1. Linears: every projection of the default model's geometry (30 layers of fused QKV, o_proj,
   gate, up, down, then the LM head), each called once in turn, so every weight streams from
   memory as in a real step: Carousel's `linear` over its packed tiles against oneDNN's
   prepacked `_linear_pointwise` (the path torch's CPU freezing uses), at each row count.
2. Decode attention: 64 sequences of 72-token contexts in scattered 16-token blocks, over 30
   layers' caches in turn (cold, as in a step): Carousel's `decode_attention` against the
   `sdpa` backend's way (gather the block tables, one masked SDPA call).

The best of `--repeats` passes; everything runs on one thread that builds nothing else (see
backends/torch/runner/device_thread.py), interleaved kernel by kernel.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from roofline import best_time  # noqa: E402

from backends.torch import cpu_kernels  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN),
          (HIDDEN, INTERMEDIATE)]  # fmt: skip


def layer_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """Every projection weight of the default model's 30 layers, random, in layer order."""
    return [torch.randn(n, k).to(dtype) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]


def paged_decode(
    dtype: torch.dtype, seqs: int, ctx: int, num_blocks: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode attention's inputs at the default model's heads (9 query, 3 K/V, 64 wide): 30
    layers' K/V caches of `num_blocks` 16-token blocks, `seqs` block tables of `ctx`-token
    contexts in scattered blocks, their lengths, and one query token a sequence."""
    heads, kv_heads, hd, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(num_blocks, block, kv_heads, hd, generator=gen).to(dtype),
         torch.randn(num_blocks, block, kv_heads, hd, generator=gen).to(dtype))
        for _ in range(LAYERS)
    ]  # fmt: skip
    width = -(-ctx // block)
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    q = torch.randn(seqs, heads, hd, generator=gen).to(dtype)
    return caches, tables, lens, q


def on_exiting_thread(fn: Callable[[], None]) -> None:
    """`fn()` on a thread that exits after it, as the engine's device thread (an OpenMP pool
    on the main thread of a script slows every later kernel; docs/benchmarks/history/)."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def linears(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    kernels = cpu_kernels.native()
    assert kernels is not None
    weights = layer_weights(dtype)
    weights.append(torch.randn(VOCAB, HIDDEN).to(dtype) * 0.02)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ours = [cpu_kernels.pack_weight(w) for w in weights]
    hint = 1 if dtype == torch.bfloat16 else 16  # layers/linear.py's oneDNN plans
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
    print(f"\nlinears, {dtype}: {len(weights)} weights, {nbytes / 1e6:.0f} MB, each once a pass")
    print("| rows | Carousel ms | GB/s | oneDNN prepacked ms | GB/s | oneDNN / Carousel |")
    print("|---|---|---|---|---|---|")
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}

        def run_ours(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, p in zip(weights, ours, strict=True):
                kernels.linear(xs[w.shape[1]], p, w.shape[0], None)

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, p in zip(weights, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        a, b = best_time(run_ours, repeats), best_time(run_onednn, repeats)
        print(f"| {m} | {a * 1e3:.2f} | {nbytes / a / 1e9:.0f} | {b * 1e3:.2f} | "
              f"{nbytes / b / 1e9:.0f} | {b / a:.2f}x |")  # fmt: skip


def attention(dtype: torch.dtype, repeats: int) -> None:
    kernels = cpu_kernels.native()
    assert kernels is not None
    seqs, ctx, num_blocks = 64, 72, 2000
    caches, tables, lens, q = paged_decode(dtype, seqs, ctx, num_blocks)
    _, heads, hd = q.shape
    _, block, kv_heads, _ = caches[0][0].shape
    width = tables.shape[1]
    out = torch.empty_like(q)
    flat = tables.reshape(-1)
    mask = (torch.arange(width * block)[None, :] < lens[:, None])[:, None, None, :]

    def run_ours() -> None:
        for k, v in caches:
            kernels.decode_attention(q, k, v, tables, lens, hd**-0.5, -1, out)

    def run_sdpa() -> None:
        for k, v in caches:
            keys = k.index_select(0, flat).view(seqs, -1, kv_heads, hd).transpose(1, 2)
            values = v.index_select(0, flat).view(seqs, -1, kv_heads, hd).transpose(1, 2)
            F.scaled_dot_product_attention(
                q.view(seqs, kv_heads, heads // kv_heads, hd), keys, values, attn_mask=mask,
                scale=hd**-0.5,
            )  # fmt: skip

    a, b = best_time(run_ours, repeats), best_time(run_sdpa, repeats)
    print(f"\ndecode attention, {dtype}: {seqs} sequences x {ctx} keys, {heads} query / "
          f"{kv_heads} K/V heads, block {block}, {LAYERS} layers' caches in turn")  # fmt: skip
    print(f"Carousel {a / LAYERS * 1e6:.0f} us a layer; gather + SDPA {b / LAYERS * 1e6:.0f} us"
          f" a layer; {b / a:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if cpu_kernels.native() is None:
        sys.exit(f"no CPU kernels here: {cpu_kernels.unavailable_reason()}")
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]

    def run() -> None:
        print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
        for dtype in dtypes:
            linears(dtype, rows, args.repeats)
            attention(dtype, args.repeats)
        print(f"\n# command: scripts/kernel_bench.py {' '.join(sys.argv[1:])}")

    on_exiting_thread(run)


if __name__ == "__main__":
    main()
