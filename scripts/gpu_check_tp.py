"""The tensor-parallel oracle of scripts/gpu-check.sh: TP = 2 over NCCL (one GPU per rank).

For each tiny architecture (fp32), greedy outputs of a TP = 2 backend under orca and static,
prompts submitted at staggered times, must equal HF `generate` of the whole model on each
prompt alone, token for token. With fewer than two GPUs it reports itself skipped.
"""

from __future__ import annotations

import random
import tempfile

import torch

from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.parallel.group import acquire_group, release_group
from backends.torch.testing.tiny_models import ARCHITECTURES, VOCAB, tiny_model, tiny_tokenizer
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams

LENGTHS, MAX_TOKENS = [3, 41, 9, 70, 1, 24], [12, 5, 20, 8, 16, 10]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def tp_rows(device: str = "cuda", size: int = 2) -> list[tuple[str, str, str]]:
    """(check, value, verdict) rows: PASS / FAIL per architecture and policy, or a skip."""
    label = f"oracle TP={size} {'nccl' if device == 'cuda' else 'gloo'}"
    if device == "cuda" and torch.cuda.device_count() < size:
        return [(label, "skipped", f"needs {size} GPUs, found {torch.cuda.device_count()}")]
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    rows = []
    group = acquire_group(size, device)  # NOTE: one group for every architecture's backend
    try:
        rows = _oracle_rows(label, device, size, prompts, params)
    finally:
        release_group(group)
    return rows


def _oracle_rows(
    label: str, device: str, size: int, prompts: list[list[int]], params: list[SamplingParams]
) -> list[tuple[str, str, str]]:
    rows = []
    for arch in ARCHITECTURES:
        model = tiny_model(arch)
        model.generation_config.eos_token_id = None
        expected = [_hf_greedy(model, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
            backend = TensorParallelBackend.load(
                path, tensor_parallel_size=size, device=device, dtype="float32",
                block_size=4, max_model_len=128, max_num_seqs=64, kv_cache_gb=0.1,
            )  # fmt: skip
        try:
            for sched in ("orca", "static"):
                config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
                with LLM(backend, sched, config) as llm:
                    gens = llm.generate(prompts, params, delays_s=[0, 0, 0.005, 0.01, 0.015, 0.02])
                got = [g.choices[0].token_ids for g in gens]
                match = sum(
                    next((i for i, (a, b) in enumerate(zip(e, g, strict=False)) if a != b), len(e))
                    for e, g in zip(expected, got, strict=True)
                )
                total = sum(MAX_TOKENS)
                verdict = "PASS" if got == expected else "FAIL"
                rows.append((f"{label} {arch} fp32 {sched}", f"{match}/{total}", verdict))
        finally:
            backend.close()
    return rows


if __name__ == "__main__":
    for row in tp_rows("cuda" if torch.cuda.is_available() else "cpu"):
        print("  ".join(row))
