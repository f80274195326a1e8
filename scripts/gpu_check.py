"""GPU check: what issue 36 asks a GPU to show, in one short run, into one JSON results file.

Needs only torch and transformers (and tokenizers, safetensors): no HTTP layer, no pytest, no
network. See scripts/gpu-check.sh, which runs it under a time limit. Sections, each recorded
as {"status": "pass" | "fail" | "measured" | "skipped" | "error", ...}:

1. `bandwidth`: a measured device-to-device copy (bytes read + written per second): the
   floor of every decode step below is taken from it, not from a datasheet.
2. `oracle_fp32`: greedy outputs of the engine (orca and static, staggered submissions)
   against HF `generate` on each prompt alone, for every tiny architecture in fp32: must
   match token for token.
3. `teacher_forced_bf16`: top-1 agreement of the engine's batched decode with HF's bf16
   forward, teacher-forced, on SmolLM2-shaped and 1B-Llama-shaped random models (>= 97%).
4. `decode_step`: the bare decode step at B = 1, 8, 64 (CUDA graphs unless
   `--enforce-eager`) against the floor (weight plus K/V bytes over the measured bandwidth)
   and against HF's own decode step, and kernel launches per step (torch profiler).
5. `burst`: 64 requests at once through the engine and through transformers' continuous
   batching (`generate_batch`) in this process: output tokens per second of each.
6. `attention`, `int4`: scripts/gpu_check_attention.py and scripts/gpu_check_int4.py, where
   those files exist, each in a subprocess with its exit status and the end of its output.

`--dry-run` (or no CUDA): the CPU runs the fp32 oracle on one architecture and the
bandwidth copy at a small size; every part that needs a GPU is recorded as skipped. A test
runs it so (tests/test_gpu_check.py). Exit status 1 when any section failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_forward import DecodeBatch, decode_step_s, hf_decode_tok_s  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from backends.torch.runner.backend import TorchBackend  # noqa: E402
from backends.torch.testing.teacher_forcing import (  # noqa: E402
    engine_logits,
    hf_logits,
    top1_agreement,
)
from backends.torch.testing.tiny_models import ARCHITECTURES, tiny_model, tiny_tokenizer  # noqa: E402
from schedulers.base import SchedulerConfig  # noqa: E402
from schedulers.llm import LLM  # noqa: E402
from schedulers.sampling_params import SamplingParams  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
SHAPES = {"smollm2": SMOLLM2, "llama-1b": LLAMA_1B}
Result = dict[str, Any]
NEEDS_CUDA = {"status": "skipped", "why": "needs CUDA (dry run)"}


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def oracle(backend: TorchBackend, vocab: int, scheduler: str) -> tuple[int, int]:
    """(matching tokens, total tokens) of staggered batched greedy vs HF alone."""
    rng = random.Random(0)
    lengths, max_tokens = [3, 41, 9, 70, 1, 24], [12, 5, 20, 8, 16, 10]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    with LLM(backend, scheduler, config) as llm:
        gens = llm.generate(prompts, params, delays_s=[0, 0, 0.005, 0.01, 0.015, 0.02])
    match = total = 0
    for prompt, m, gen in zip(prompts, max_tokens, gens, strict=True):
        expected = hf_greedy(backend.hf_model, prompt, m, backend.device)
        total += m
        for a, b in zip(expected, gen.choices[0].token_ids, strict=False):
            if a != b:
                break
            match += 1
    return match, total


def bandwidth(device: torch.device, dry: bool) -> Result:
    """Bytes read plus written per second by a large device-to-device copy."""
    size = (16 if dry else 2048) * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    began, reps = time.perf_counter(), 3 if dry else 20
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - began) / reps
    return {"status": "measured", "gb_s": round(2 * size / seconds / 1e9, 1), "bytes": size}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def oracle_fp32(device: torch.device, archs: list[str], eager: bool) -> Result:
    rows = {}
    for arch in archs:
        model = tiny_model(arch)
        model.generation_config.eos_token_id = None
        backend = TorchBackend(model, tiny_tokenizer(), device=str(device), dtype="float32",
                               block_size=4, max_model_len=128, max_num_seqs=64,
                               enforce_eager=eager)  # fmt: skip
        for sched in ("orca", "static"):
            m, t = oracle(backend, 320, sched)
            rows[f"{arch} {sched}"] = f"{m}/{t}"
        backend.close()
    ok = all(a == b for a, b in (v.split("/") for v in rows.values()))
    return {"status": "pass" if ok else "fail", "matching_tokens": rows}


def random_model(shape: str, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(device, torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def shaped_backend(model: LlamaForCausalLM, device: torch.device, eager: bool) -> TorchBackend:
    return TorchBackend(model, tiny_tokenizer(), device=str(device), dtype="bfloat16",
                        kv_cache_gb=4.0, max_model_len=2048, max_num_seqs=64,
                        enforce_eager=eager)  # fmt: skip


def teacher_forced(device: torch.device, eager: bool) -> Result:
    out: Result = {}
    for shape in SHAPES:
        model = random_model(shape, device)
        rng = random.Random(1)
        texts = [[rng.randrange(1000) for _ in range(96)] for _ in range(8)]
        backend = shaped_backend(model, device, eager)
        share = top1_agreement(engine_logits(backend, texts, 32), hf_logits(model, texts, 32))
        out[shape] = round(share, 4)
        backend.close()
        del model, backend
        torch.cuda.empty_cache()
    ok = all(v >= 0.97 for v in out.values())
    return {"status": "pass" if ok else "fail", "top1_agreement": out, "target": 0.97}


def launches_per_step(backend: TorchBackend, batch: int) -> int:
    """CUDA kernel and graph launches the host issues in one decode step (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    run = DecodeBatch(backend, batch, 64, 4)  # its prefill is not counted
    run.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.step()
        torch.cuda.synchronize()
    run.close()
    names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def decode_steps(device: torch.device, gb_s: float, eager: bool, steps: int) -> Result:
    out: Result = {}
    for shape in SHAPES:
        model = random_model(shape, device)
        backend = shaped_backend(model, device, eager)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        layout = backend.kv_cache.layout
        rows = {}
        for b in (1, 8, 64):
            step_ms = decode_step_s(backend, b, 64, steps) * 1e3
            kv_bytes = b * 64 * layout.bytes_per_block // layout.block_size
            floor_ms = (weights + kv_bytes) / (gb_s * 1e9) * 1e3
            hf_ms = b / hf_decode_tok_s(model, b, 64, steps) * 1e3
            rows[f"B={b}"] = {
                "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
                "x_floor": round(step_ms / floor_ms, 2), "hf_step_ms": round(hf_ms, 3),
            }  # fmt: skip
        rows["launches_per_step_B=1"] = launches_per_step(backend, 1)
        rows["graphs"] = backend.graphs is not None
        out[shape] = rows
        backend.close()
        del model, backend
        torch.cuda.empty_cache()
    return {"status": "measured", **out}


def burst(device: torch.device, eager: bool, num: int = 64, max_new: int = 128) -> Result:
    """`num` requests at once: the engine (orca) and transformers' continuous batching."""
    from transformers import GenerationConfig

    model = random_model("smollm2", device)
    rng = random.Random(2)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(16, 256))] for _ in range(num)]
    backend = shaped_backend(model, device, eager)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)
    with LLM(backend, "orca", config) as llm:
        llm.generate(prompts[:4], [params] * 4)  # warm-up
        began = time.perf_counter()
        llm.generate(prompts, [params] * num)
        ours = num * max_new / (time.perf_counter() - began)
    backend.close()
    out: Result = {"status": "measured", "ours_tok_s": round(ours, 1)}
    try:
        gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)  # fmt: skip
        model.generate_batch(inputs=prompts[:4], generation_config=gen)  # warm-up
        began = time.perf_counter()
        model.generate_batch(inputs=prompts, generation_config=gen)
        theirs = num * max_new / (time.perf_counter() - began)
        out |= {"hf_generate_batch_tok_s": round(theirs, 1), "x_hf": round(ours / theirs, 2)}
    except Exception as error:  # the API moves between transformers versions: say so
        out["hf_generate_batch_error"] = repr(error)[:300]
    return out


def other_check(name: str, timeout_s: int) -> Result:
    path = ROOT / "scripts" / name
    if not path.exists():
        return {"status": "skipped", "why": f"no scripts/{name} on this branch"}
    try:
        done = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "fail", "why": f"over {timeout_s} s"}
    tail = (done.stdout + done.stderr)[-2000:]
    return {"status": "pass" if done.returncode == 0 else "fail", "rc": done.returncode,
            "tail": tail}  # fmt: skip


def run_section(results: Result, name: str, fn: Callable[[], Result]) -> None:
    began = time.monotonic()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"status": "error", "traceback": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.monotonic() - began, 1)
    print(f"{name}: {json.dumps(results[name])[:400]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="CPU: skip the GPU parts")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="results folder")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per size")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    began = time.monotonic()
    results: Result = {
        "device": "cpu" if dry else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "dry_run": dry, "enforce_eager": args.enforce_eager,
    }  # fmt: skip
    eager = args.enforce_eager
    run_section(results, "bandwidth", lambda: bandwidth(device, dry))
    archs = ARCHITECTURES[:1] if dry else list(ARCHITECTURES)
    run_section(results, "oracle_fp32", lambda: oracle_fp32(device, archs, eager))
    gb_s = float(results["bandwidth"].get("gb_s", 0.0)) or 1.0
    gpu_sections: list[tuple[str, Callable[[], Result]]] = [
        ("teacher_forced_bf16", lambda: teacher_forced(device, eager)),
        ("decode_step", lambda: decode_steps(device, gb_s, eager, args.steps)),
        ("burst", lambda: burst(device, eager)),
        ("attention", lambda: other_check("gpu_check_attention.py", 150)),
        ("int4", lambda: other_check("gpu_check_int4.py", 150)),
    ]
    for name, fn in gpu_sections:
        if dry:
            results[name] = dict(NEEDS_CUDA)
        else:
            run_section(results, name, fn)
    results["seconds"] = round(time.monotonic() - began, 1)
    out = Path(args.out) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"# results in {out}, {results['seconds']} s")
    failed = [k for k, v in results.items() if isinstance(v, dict) and v["status"] == "fail"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
