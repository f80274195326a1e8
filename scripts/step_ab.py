"""Decode-step A/B of backend variants over the same weights, interleaved step by step.

    python scripts/step_ab.py --dtype bfloat16 --batch-sizes 1,32 --steps 16 \
        sdpa:attention_backend=sdpa paged:attention_backend=inductor_paged \
        compiled:attention_backend=inductor_paged,compile=true

Each variant (`NAME:KEY=VALUE,...`, `TorchBackend` keyword arguments, as in roofline.py, and
`generic_fusion=false`: the generic path without its fused swaps, backends/torch/generic/;
`offset_norms=false`: without its `(1 + w)` norms on the kernel, generic/norms.py) of
`--model` gets one batch of B sequences with 64-token prompts (scripts/bench_forward.py's
`DecodeBatch`); the decode steps then go round-robin across the variants, so a load spike on
a shared machine lands on all of them alike. Prints the median step of each (wall and
process CPU time) and its speed relative to the first variant.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_forward import DecodeBatch  # noqa: E402
from roofline import parse_variant  # noqa: E402

from backends.torch.generic import fusion  # noqa: E402
from backends.torch.generic import model as generic_model  # noqa: E402
from backends.torch.runner.backend import TorchBackend  # noqa: E402


@contextlib.contextmanager
def generic_fusion(kwargs: dict[str, Any]) -> Iterator[None]:
    """The variant's `generic_fusion` and `offset_norms` (taken out of `kwargs`) while its
    model is built."""
    before, offset = generic_model.FUSE, fusion.offset_norms
    generic_model.FUSE = bool(kwargs.pop("generic_fusion", before))
    if not kwargs.pop("offset_norms", True):
        fusion.offset_norms = lambda *_: []  # type: ignore[assignment]
    try:
        yield
    finally:
        generic_model.FUSE, fusion.offset_norms = before, offset


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default", help="a model name or HF directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("variants", nargs="+", help="NAME:KEY=VALUE,...")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    first_name, first_kwargs = variants[0]
    with generic_fusion(first_kwargs):
        base = TorchBackend.load(args.model, device="cpu", dtype=args.dtype, kv_cache_gb=0.6,
                                 max_model_len=512, **first_kwargs)  # fmt: skip
    backends = {first_name: base}
    for name, kwargs in variants[1:]:
        with generic_fusion(kwargs):
            backends[name] = TorchBackend.create(base.hf_model, base.tokenizer, device="cpu",
                                          dtype=args.dtype, kv_cache_gb=0.6, max_model_len=512,
                                          **kwargs)  # fmt: skip
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = {
            n: DecodeBatch(b, batch, args.prompt_len, args.steps + 1) for n, b in backends.items()
        }
        wall: dict[str, list[float]] = {n: [] for n in runs}
        cpu: dict[str, list[float]] = {n: [] for n in runs}
        for run in runs.values():  # one untimed step each
            run.step()
        for _ in range(args.steps):
            for name, run in runs.items():
                began, began_cpu = time.perf_counter(), time.process_time()
                run.step()
                cpu[name].append(time.process_time() - began_cpu)
                wall[name].append(time.perf_counter() - began)
        for run in runs.values():
            run.close()
        ref = statistics.median(wall[first_name])
        cells = []
        for name, times in wall.items():
            step = statistics.median(times)
            cpu_ms = statistics.median(cpu[name]) * 1e3
            cells.append(f"{name} {step * 1e3:.1f} ms ({ref / step:.2f}x, cpu {cpu_ms:.1f} ms)")
        print(f"{args.dtype} B={batch}: " + "; ".join(cells), flush=True)
    print(f"# command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
