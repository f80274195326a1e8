"""Evidence for the CPU default dtype: bf16 against fp32 on fixed prompts and a fixed text.

    python scripts/dtype_quality.py [--max-new 48] [--attention-backend auto] [--compile]

Both dtypes run the engine (TorchBackend, as shipped) over the same weights:
1. Greedy answers to the fixed chat prompts of testing/fixed_texts.py (EOS ignored, `--max-new`
   tokens): how many answers are identical, and where the others first part.
2. Perplexity of the fixed public-domain passages, teacher-forced through the engine's
   batched decode path (testing/teacher_forcing.py), both dtypes and HF's own forward in
   both; and the share of positions where the top-1 tokens agree (engine against HF in the
   same dtype: the oracle criterion where kernels legitimately differ; bf16 against fp32).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from backends.torch.runner.backend import TorchBackend  # noqa: E402
from backends.torch.testing.fixed_texts import PASSAGES, QUESTIONS  # noqa: E402
from backends.torch.testing.teacher_forcing import (  # noqa: E402
    engine_greedy,
    engine_logits,
    hf_logits,
    top1_agreement,
)

PREFIX = 8


def perplexity(logits: list[torch.Tensor], texts: list[list[int]]) -> float:
    """exp(mean negative log-likelihood) of the true tokens after the prefix."""
    nll = [
        -lg.log_softmax(-1).gather(-1, torch.tensor(t[PREFIX:])[:, None]).squeeze(-1)
        for lg, t in zip(logits, texts, strict=True)
    ]
    return math.exp(torch.cat(nll).mean().item())


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    backends = [
        TorchBackend.load(
            "default",
            device="cpu",
            dtype=dtype,
            kv_cache_gb=0.5,
            max_model_len=1024,
            attention_backend=args.attention_backend,
            compile=args.compile,
        )  # fmt: skip
        for dtype in ("float32", "bfloat16")
    ]
    fp32, bf16 = backends
    tokenizer = fp32.tokenizer
    encoded = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]  # fmt: skip
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in encoded]
    answers = {name: engine_greedy(b, prompts, args.max_new) for name, b in
               (("fp32", fp32), ("bf16", bf16))}  # fmt: skip
    same = 0
    print("## Greedy answers, fp32 vs bf16\n")
    for question, a32, a16 in zip(QUESTIONS, answers["fp32"], answers["bf16"], strict=True):
        parted = next((i for i, (x, y) in enumerate(zip(a32, a16, strict=True)) if x != y), None)
        same += parted is None
        print(f"- {question}")
        print(f"  - fp32: {tokenizer.decode(a32)!r}")
        verdict = "identical" if parted is None else f"parts at token {parted}"
        print(f"  - bf16 ({verdict}): {tokenizer.decode(a16)!r}")
    print(f"\nidentical answers: {same}/{len(QUESTIONS)} ({args.max_new} tokens each)\n")

    texts = [list(tokenizer(p)["input_ids"]) for p in PASSAGES]
    l32, l16 = engine_logits(fp32, texts, PREFIX), engine_logits(bf16, texts, PREFIX)
    hf32, hf16 = hf_logits(fp32.hf_model, texts, PREFIX), hf_logits(bf16.hf_model, texts, PREFIX)
    n = sum(len(t) - PREFIX for t in texts)
    print(f"## Perplexity of {len(texts)} fixed passages ({n} teacher-forced tokens)\n")
    print(f"- HF forward, fp32: {perplexity(hf32, texts):.3f}")
    print(f"- HF forward, bf16: {perplexity(hf16, texts):.3f}")
    print(f"- engine, fp32: {perplexity(l32, texts):.3f}")
    print(f"- engine, bf16: {perplexity(l16, texts):.3f}")
    print(f"- top-1 agreement engine fp32 vs HF fp32: {top1_agreement(l32, hf32):.2%}")
    print(f"- top-1 agreement engine bf16 vs HF bf16: {top1_agreement(l16, hf16):.2%}")
    print(f"- top-1 agreement engine bf16 vs engine fp32: {top1_agreement(l16, l32):.2%}")
    print(f"\ncommand: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
