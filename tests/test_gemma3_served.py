"""Gemma 3 270M served for real (issue 50): the base model through `/v1/completions`, on the
generic path (`--model-impl auto` picks it: Gemma 3 is no native family), greedy in fp32 under
orca and static, token for token what HF `generate` continues, BOS included as HF's tokenizer
and llama.cpp add it; one prompt outruns the sliding window. Skips without the package unless
CAROUSEL_REQUIRE_GEMMA3=1 (CI)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.serve_process import carousel_serve
from tests.test_gemma3_package import gemma_dir  # noqa: F401

#: the last is longer than the 512-token window: its sliding layers drop the blocks behind it
#: (kv_cache.py's groups) once it decodes
PROMPTS = [
    "def fibonacci(n):", "Once upon a time", "The capital of France is",
    "Count on: " + " ".join(str(i) for i in range(200)),
]  # fmt: skip
MAX_TOKENS = 12
CONFIG = """model: gemma-3-270m
dtype: float32
max_num_seqs: 4
kv_cache_gb: 0.2
max_model_len: 2048
arms:
  - name: orca
    scheduler: orca
  - name: static
    scheduler: static
    batch_wait_ms: 20
"""


def hf_continuations(folder: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.real_model
def test_gemma_3_completions_equal_hf_generate_under_orca_and_static(
    gemma_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    want = hf_continuations(gemma_dir)
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    (tmp_path / "gemma.yaml").write_text(CONFIG)
    with carousel_serve(["--config", "gemma.yaml"], tmp_path) as url:
        for arm in ("orca", "static"):
            for prompt, tokens in zip(PROMPTS, want, strict=True):
                body = {
                    "model": "gemma-3-270m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "logprobs": 0,
                }  # fmt: skip
                reply = httpx.post(
                    f"{url}/v1/completions", json=body, headers={"X-Carousel-Arm": arm},
                    timeout=120,
                ).json()  # fmt: skip
                choice = reply["choices"][0]
                assert reply["usage"]["prompt_tokens"] == len(tokenizer(prompt).input_ids)
                assert choice["text"] == tokenizer.decode(tokens), (arm, prompt)
