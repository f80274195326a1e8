"""Carousel's CPU kernels at another commit against the work tree's, interleaved in one process.

    python scripts/kernel_ab.py --base HEAD~1 [--rows 1,8,32,64] [--dtypes float32,bfloat16]
        [--no-amx] [--attention] [--rounds 11]

Builds backends/torch/cpu_kernels/csrc/ as it is at `--base` (git archive) under its own
module name (`cpu_kernels.build_variant`: two builds under one name cannot share a process,
the second import returns the first), and the work tree's as `native()` does. Then, round
after round, each build in turn runs the same work: every linear of the default model's 30
layers once (each weight streams from memory, as in a decode step) at each row count, and
with `--attention` decode attention of 8, 32 and 64 sequences over 30 layers' caches. A load
spike on a shared machine lands on both builds alike; the figure is the median over rounds of
base time / tree time (above 1: the tree is faster), with its range.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from kernel_bench import HIDDEN, INTERMEDIATE, layer_weights, on_exiting_thread, paged_decode  # noqa: E402

from backends.torch import cpu_kernels  # noqa: E402

CSRC = cpu_kernels.CSRC.relative_to(ROOT)

Work = Callable[[ModuleType], object]


def base_build(rev: str) -> ModuleType:
    """The kernels as they are at `rev`, built as module carousel_cpu_kernels_base."""
    tree = Path(tempfile.mkdtemp(prefix="carousel-kernel-ab-"))
    archive = subprocess.run(["git", "archive", rev, str(CSRC)], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return cpu_kernels.build_variant(tree / CSRC, "carousel_cpu_kernels_base")


def linear_work(dtype: torch.dtype, rows: int) -> Work:
    weights = layer_weights(dtype)
    packed = [cpu_kernels.pack_weight(w) for w in weights]
    xs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}

    def run(kernels: ModuleType) -> None:
        for w, p in zip(weights, packed, strict=True):
            kernels.linear(xs[w.shape[1]], p, w.shape[0], None)

    return run


def attention_work(dtype: torch.dtype, seqs: int, ctx: int = 72) -> Work:
    caches, tables, lens, q = paged_decode(dtype, seqs, ctx, num_blocks=3000)
    scale = q.shape[2] ** -0.5
    out = torch.empty_like(q)

    def run(kernels: ModuleType) -> None:
        for k, v in caches:
            kernels.decode_attention(q, k, v, tables, lens, scale, -1, out)

    return run


def interleaved(work: Work, builds: list[ModuleType], rounds: int) -> list[list[float]]:
    """Seconds of `work` per round with each build, the builds taking turns (after a warm-up)."""
    times: list[list[float]] = [[] for _ in builds]
    for kernels in builds:
        work(kernels)
    for _ in range(rounds):
        for i, kernels in enumerate(builds):
            start = time.perf_counter()
            work(kernels)
            times[i].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-amx", action="store_true", help="bf16 on AVX512-BF16 in both")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    tree = cpu_kernels.native()
    if tree is None:
        sys.exit(f"no CPU kernels here: {cpu_kernels.why_off()}")
    base = base_build(args.base)
    builds = [base, tree]
    if args.no_amx:
        for kernels in builds:
            kernels.set_amx_min_rows(cpu_kernels.AMX_OFF)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    cases: list[tuple[str, Callable[[], Work]]] = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for rows in [int(r) for r in args.rows.split(",")]:
            cases.append((f"linears {name}, {rows} rows",
                          lambda d=dtype, r=rows: linear_work(d, r)))  # fmt: skip
        if args.attention:
            for seqs in (8, 32, 64):
                cases.append((f"attention {name}, {seqs} seqs",
                              lambda d=dtype, s=seqs: attention_work(d, s)))  # fmt: skip

    def run() -> None:
        print(f"# base {args.base}, torch {torch.__version__}, {torch.get_num_threads()} threads,"
              f" {args.rounds} rounds, AMX {'off' if args.no_amx else 'as built'}")  # fmt: skip
        print("| work | base ms | tree ms | base / tree | range over rounds |")
        print("|---|---|---|---|---|")
        for label, make in cases:
            before, after = interleaved(make(), builds, args.rounds)
            ratios = [b / a for b, a in zip(before, after, strict=True)]
            print(f"| {label} | {statistics.median(before) * 1e3:.2f} | "
                  f"{statistics.median(after) * 1e3:.2f} | {statistics.median(ratios):.2f}x | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} |", flush=True)  # fmt: skip
        print(f"\n# command: scripts/kernel_ab.py {' '.join(sys.argv[1:])}")

    on_exiting_thread(run)


if __name__ == "__main__":
    main()
