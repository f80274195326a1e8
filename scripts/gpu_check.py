"""GPU readiness check: oracle equality and decode efficiency on a CUDA machine.

Needs only torch, transformers (and tokenizers, safetensors, accelerate): no HTTP layer,
no pytest, no network. Prints one short table. See scripts/gpu-check.sh. Every attention
backend available on the device (backends/torch/attention/) is checked, eager and compiled.

1. Oracle: greedy outputs of the engine (orca and static, staggered submissions) against
   HF `generate` on each prompt alone, for tiny Llama/Mistral/Qwen2/Qwen3 models in fp32
   (must match exactly) and for a SmolLM2-135M-shaped model in the device's serving dtype
   (bf16 on cuda; reported as the share of matching tokens: bf16 kernels differ).
   The real default model is used when its converted directory is in the cache (it cannot
   be converted here without the `gguf` package); otherwise random weights of its shape.
2. Efficiency: decode tokens/s at B = 1, 8, 32, 64 for HF's forward with its KV cache and
   for our backend's bare execute loop, and our step time against the floor of weight bytes
   over memory bandwidth.
3. Tensor parallelism (scripts/gpu_check_tp.py): the tiny models' oracle at TP = 2 over NCCL,
   one GPU per rank; reported as skipped when fewer than two GPUs are visible.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_forward import engine_decode_tok_s, hf_decode_tok_s  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from backends.torch.attention import available_backends  # noqa: E402
from backends.torch.runner import TorchBackend  # noqa: E402
from backends.torch.testing.tiny_models import ARCHITECTURES, tiny_model, tiny_tokenizer  # noqa: E402
from schedulers.base import SchedulerConfig  # noqa: E402
from schedulers.llm import LLM  # noqa: E402
from schedulers.sampling_params import SamplingParams  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


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
        got = gen.choices[0].token_ids
        total += m
        for a, b in zip(expected, got, strict=False):
            if a != b:
                break
            match += 1
    return match, total


def default_model_dir() -> Path | None:
    cache = Path(os.environ.get("CAROUSEL_CACHE_DIR", Path.home() / ".cache" / "carousel"))
    path = cache / "models" / "smollm2-135m-instruct"
    return path if (path / "config.json").exists() else None


def path_label(attention: str, compiled: bool, backend: TorchBackend) -> str:
    """The forward path a row measured (a compile that failed ran eager, and says so)."""
    if not compiled:
        return attention
    return f"{attention} compiled" if backend.model.compiled else f"{attention} (compile failed)"


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="H200: 4.8 TB/s")
    parser.add_argument("--attention-backends", default="", help="comma list; default: all")
    args = parser.parse_args()
    device = torch.device(args.device)
    began = time.monotonic()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# gpu-check on {name}, torch {torch.__version__}")
    rows = []
    names = args.attention_backends.split(",") if args.attention_backends else None
    variants = [(name, compiled) for name in names or available_backends(device)
                for compiled in (False, True)]  # fmt: skip
    for attention, compiled in variants:
        for arch in ARCHITECTURES:
            model = tiny_model(arch)
            model.generation_config.eos_token_id = None
            backend = TorchBackend(model, tiny_tokenizer(), device=args.device, dtype="float32",
                                   block_size=4, max_model_len=128, max_num_seqs=64,
                                   attention_backend=attention, compile=compiled)  # fmt: skip
            label = path_label(attention, compiled, backend)
            for sched in ("orca", "static"):
                m, t = oracle(backend, 320, sched)
                verdict = "PASS" if m == t else "FAIL"
                rows.append((f"oracle {label} {arch} fp32 {sched}", f"{m}/{t}", verdict))
    path = default_model_dir()
    for attention, compiled in variants:
        kwargs = dict(device=args.device, kv_cache_gb=2.0, max_model_len=2048,
                      attention_backend=attention, compile=compiled)  # fmt: skip
        if path is not None:
            backend = TorchBackend.load(str(path), **kwargs)  # type: ignore[arg-type]
            model_label = "default model"
        else:
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
            backend = TorchBackend(model, tiny_tokenizer(), **kwargs)  # type: ignore[arg-type]
            model_label = "smollm2-shaped random"
        label = path_label(attention, compiled, backend)
        for sched in ("orca", "static"):
            m, t = oracle(backend, 49152, sched)
            rows.append((f"oracle {label} {model_label} {backend.dtype} {sched}", f"{m}/{t}",
                         f"{m / t:.0%} match"))  # fmt: skip
        weight_bytes = sum(p.numel() * p.element_size() for p in backend.hf_model.parameters())
        floor_ms = weight_bytes / (args.bandwidth_gbs * 1e9) * 1e3
        for b in (int(x) for x in args.batch_sizes.split(",")):
            engine_decode_tok_s(backend, b, 64, 4)
            hf = hf_decode_tok_s(backend.hf_model, b, 64, args.steps)
            ours = engine_decode_tok_s(backend, b, 64, args.steps)
            step_ms = b / ours * 1e3
            verdict = f"ours/hf {ours / hf:.2f}; step {step_ms:.2f} ms vs floor {floor_ms:.3f} ms"
            rows.append((f"decode {label} B={b}", f"hf {hf:.0f} tok/s, ours {ours:.0f} tok/s",
                         verdict))  # fmt: skip
        backend.close()
    if device.type == "cuda":  # tensor parallelism over NCCL, when two GPUs are lent
        from gpu_check_tp import tp_rows

        rows += tp_rows("cuda")
    width = max(len(r[0]) for r in rows)
    for check, value, verdict in rows:
        print(f"{check:<{width}}  {value:<32}  {verdict}")
    print(f"# done in {time.monotonic() - began:.0f} s")
    if any(v == "FAIL" for _, _, v in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
