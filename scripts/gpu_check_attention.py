"""GPU check of the Triton paged attention (`triton_paged`): correctness, then decode timings.

Run on a CUDA machine: `python scripts/gpu_check_attention.py OUT.json` (scripts/gpu-check.sh
calls `main(out_path)`). Needs only torch and triton. Writes one JSON file:

1. `correctness`: the store and attention kernels against a float64 reference written from
   the definition (softmax over each sequence's keys up to its position, within the window),
   on batches mixing prefills, a prefill chunk over a cached context and decodes, for GQA
   groups 1/3/4, head dims 64-128, windows, fp32 / bf16 / fp16 caches. Cache slots outside
   every context hold NaN, so reading anything else shows.
2. `decode`: one decode step of attention (one layer) at B = 1, 8, 64 on SmolLM2-135M's
   and a 1B Llama's geometry in bf16, contexts of 256-2048 tokens, with and without one
   8192-token sequence in the batch (`long_over_short`: what that one sequence costs the
   step; near 1 at B = 64 means the others do not pay 8k), against `sdpa` (gather + padded
   masked SDPA, where every decode pays the longest context) on the same batch.

Without CUDA it writes `{"skipped": "no CUDA device"}` and returns 0.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.torch.attention import create_backend  # noqa: E402
from backends.torch.attention.base import AttentionSpec, BatchLayout  # noqa: E402
from backends.torch.kv_cache import KVCache, KVLayout  # noqa: E402
from backends.torch.runner.inputs import build_layout  # noqa: E402

#: (num_kv_heads, group, head_dim, window, block_size, schedule of (new tokens, cached), dtype)
Case = tuple[int, int, int, int | None, int, list[tuple[int, int]], str]
CORRECTNESS: list[Case] = [
    (3, 3, 64, None, 16, [(37, 0), (1, 0), (20, 45), (1, 15), (1, 16), (1, 300)], "float32"),
    (8, 4, 128, None, 16, [(1, 8191), (1, 31), (64, 0), (1, 1)], "bfloat16"),
    (2, 1, 64, 100, 16, [(130, 0), (1, 500), (9, 200)], "bfloat16"),
    (4, 4, 80, 33, 8, [(1, 64), (17, 16), (1, 0)], "float16"),
]
#: name: (num_heads, num_kv_heads, head_dim)
GEOMETRIES = {"smollm2-135m": (9, 3, 64), "llama-1b": (32, 8, 64)}
BATCH_SIZES = (1, 8, 64)
LONG_CONTEXT = 8192


def layout_of(
    schedule: list[tuple[int, int]], block_size: int, device: torch.device, rng: random.Random
) -> tuple[BatchLayout, int]:
    """A step's layout over scattered blocks 1.. (block 0 is never handed out)."""
    widths = [-(-(new + cached) // block_size) for new, cached in schedule]
    blocks = list(range(1, sum(widths) + 1))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(w)] for w in widths]
    cu = [0]
    slots = []
    for table, (new, cached) in zip(tables, schedule, strict=True):
        cu.append(cu[-1] + new)
        positions = range(cached, cached + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
    width = max(widths)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ctx = torch.tensor([new + cached for new, cached in schedule])
    layout = build_layout(torch.tensor(cu), ctx, torch.tensor(slots), padded, block_size, device)
    return layout, sum(widths) + 1


def reference(
    q: torch.Tensor, cache: KVCache, layout: BatchLayout, spec: AttentionSpec
) -> torch.Tensor:
    """(N, nh, hd) float64, from the definition over each sequence's context slots."""
    bs, out = cache.block_size, []
    keys_all = cache.k[0].view(-1, spec.num_kv_heads, spec.head_dim)
    values_all = cache.v[0].view(-1, spec.num_kv_heads, spec.head_dim)
    tables = layout.block_tables.cpu()
    for i, (start, new, ctx) in enumerate(
        zip(layout.query_starts, layout.seqlens_q, layout.seqlens_k, strict=True)
    ):
        ids = tables[i, torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
        ids = ids.to(q.device)
        k = keys_all[ids].double().repeat_interleave(spec.group_size, 1).transpose(0, 1)
        v = values_all[ids].double().repeat_interleave(spec.group_size, 1).transpose(0, 1)
        scores = q[start : start + new].double().transpose(0, 1) @ k.transpose(1, 2) * spec.scale
        q_pos = torch.arange(ctx - new, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if spec.sliding_window is not None:
            allowed &= k_pos > q_pos - spec.sliding_window
        out.append((scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


def check_correctness(device: torch.device, cases: list[Case]) -> list[dict[str, Any]]:
    rng = random.Random(0)
    torch.manual_seed(0)
    results = []
    for nkv, group, hd, window, bs, schedule, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        spec = AttentionSpec(nkv * group, nkv, hd, hd**-0.5, window)
        layout, num_blocks = layout_of(schedule, bs, device, rng)
        cache = KVCache(KVLayout(1, nkv, hd, bs, dtype), num_blocks, device)
        cache.k[0].fill_(math.nan)
        cache.v[0].fill_(math.nan)
        cached_slots = []  # what earlier steps stored: every context slot not written now
        for i, (_, cached) in enumerate(schedule):
            p = torch.arange(cached)
            table = layout.block_tables[i].cpu()
            cached_slots.append(table[p // bs] * bs + p % bs)
        prior = torch.cat(cached_slots).to(device)
        cache.k[0].view(-1, nkv, hd)[prior] = torch.randn(len(prior), nkv, hd).to(device, dtype)
        cache.v[0].view(-1, nkv, hd)[prior] = torch.randn(len(prior), nkv, hd).to(device, dtype)
        n = layout.num_tokens
        q = torch.randn(n, spec.num_heads, hd).to(device, dtype)
        k, v = (torch.randn(n, nkv, hd).to(device, dtype) for _ in range(2))
        backend = create_backend("triton_paged", cache, [spec], device)
        meta = backend.build_metadata(layout)
        backend.write_kv(0, k, v, meta)
        out = backend.attend(0, q, k, v, meta)
        error = (out.double() - reference(q, cache, layout, spec)).abs().max().item()
        tol = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 4e-3}[dtype_name]
        results.append(
            {"group": group, "head_dim": hd, "window": window, "block_size": bs,
             "dtype": dtype_name, "schedule": schedule, "max_abs_error": error,
             "ok": bool(error <= tol)}
        )  # fmt: skip
    return results


def time_us(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median microseconds per call."""
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e6)
    return sorted(times)[len(times) // 2]


def decode_us(
    name: str, geometry: tuple[int, int, int], contexts: list[int], device: torch.device,
    repeats: int,
) -> float:  # fmt: skip
    """One layer's decode attention (metadata built once, as a step does) for `contexts`."""
    nh, nkv, hd = geometry
    rng = random.Random(1)
    spec = AttentionSpec(nh, nkv, hd, hd**-0.5, None)
    layout, num_blocks = layout_of([(1, c - 1) for c in contexts], 16, device, rng)
    cache = KVCache(KVLayout(1, nkv, hd, 16, torch.bfloat16), num_blocks, device)
    cache.k[0].normal_()
    cache.v[0].normal_()
    q = torch.randn(len(contexts), nh, hd, device=device, dtype=torch.bfloat16)
    k = torch.randn(len(contexts), nkv, hd, device=device, dtype=torch.bfloat16)
    backend = create_backend(name, cache, [spec], device)
    meta = backend.build_metadata(layout)
    return time_us(lambda: backend.attend(0, q, k, k, meta), device, repeats)


def check_decode(device: torch.device, batch_sizes: tuple[int, ...], long: int, repeats: int,
                 backends: tuple[str, ...]) -> list[dict[str, Any]]:  # fmt: skip
    rng = random.Random(2)
    rows = []
    for geometry_name, geometry in GEOMETRIES.items():
        for batch in batch_sizes:
            short = [rng.randint(256, 2048) for _ in range(batch)]
            mixed = [long, *short[1:]]
            row: dict[str, Any] = {"geometry": geometry_name, "batch": batch}
            for name in backends:
                row[f"{name}_short_us"] = decode_us(name, geometry, short, device, repeats)
                row[f"{name}_with_{long}_us"] = decode_us(name, geometry, mixed, device, repeats)
            first = backends[0]
            row["long_over_short"] = row[f"{first}_with_{long}_us"] / row[f"{first}_short_us"]
            rows.append(row)
    return rows


def run(
    device: torch.device,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    long: int = LONG_CONTEXT,
    repeats: int = 50,
    backends: tuple[str, ...] = ("triton_paged", "sdpa"),
    cases: list[Case] = CORRECTNESS,
) -> dict[str, Any]:
    """Every check on `device` (CUDA; the CPU only under TRITON_INTERPRET=1, for its test)."""
    began = time.monotonic()
    correctness = check_correctness(device, cases)
    decode = check_decode(device, batch_sizes, long, repeats, backends)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ok": all(r["ok"] for r in correctness),
        "correctness": correctness,
        "decode": decode,
        "seconds": round(time.monotonic() - began, 1),
    }


def main(out_path: str | Path) -> int:
    """Run the checks on CUDA (or record that there is none); 1 if the kernels are wrong."""
    if not torch.cuda.is_available():
        result: dict[str, Any] = {"skipped": "no CUDA device"}
    else:
        import triton

        result = {"triton": triton.__version__, **run(torch.device("cuda"))}
    Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result.get("decode", result), indent=2))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_attention.json"))
