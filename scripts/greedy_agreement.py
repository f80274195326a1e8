"""Greedy answers of several endpoints to the same chat prompts, compared with the first's.

    python scripts/greedy_agreement.py --llama-server llama.cpp-build/bin/llama-server \
        --quantization gguf --quantization none

The endpoints are given and started as in scripts/single_stream.py (`--llama-server`, first
when given, `--quantization`, `--carousel`, `--url`). Each answers every prompt of `PROMPTS`
once, unstreamed, at temperature 0 with `max_tokens` (default 64), stopping where the model
stops. The prompts go to `/v1/completions` as text already in the chat template of Carousel's
default model (its tokenizer's `apply_chat_template`, which adds SmolLM2's default system
prompt), so every endpoint reads the same tokens: through `/v1/chat/completions` llama.cpp's
server applies a template of its own, and its answers then part from the first word.

Per endpoint after the first it prints how many answers equal the first endpoint's exactly,
and the mean share of the first endpoint's words that each answer repeats before the two part
(1.0: every answer the same). Greedy decoding through different kernels
(llama.cpp's Q4_1 x Q8_1 dot products, torch's int4 op, bf16) rounds differently, so two
answers part where the top two tokens were nearly tied; this reports how often, it does not
require any agreement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from single_stream import Endpoint, named, servers  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "What is 17 times 3?",
    "Give me a short tip for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write one sentence about the moon.",
    "What should I pack for a weekend hike?",
    "Name a famous painter and one of their paintings.",
    "Summarize the story of Cinderella in three sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
)


@dataclass(frozen=True)
class Agreement:
    """How one endpoint's answers compare with the reference endpoint's."""

    exact: int
    answers: int
    mean_shared_prefix: float  # share of the reference's words repeated before the answers part


def shared_prefix(reference: str, other: str) -> float:
    """The share of `reference`'s words that `other` repeats, in order, from the start."""
    ref, got = reference.split(), other.split()
    if not ref:
        return 1.0 if not got else 0.0
    same = 0
    for a, b in zip(ref, got, strict=False):  # parts at the shorter one's end at the latest
        if a != b:
            break
        same += 1
    return same / len(ref)


def agreement(reference: list[str], answers: list[str]) -> Agreement:
    """`answers` against `reference`, prompt by prompt (the same order)."""
    if len(reference) != len(answers):
        raise ValueError("one answer per prompt on each side")
    exact = sum(a == b for a, b in zip(reference, answers, strict=True))
    prefixes = [shared_prefix(a, b) for a, b in zip(reference, answers, strict=True)]
    return Agreement(exact, len(answers), statistics.fmean(prefixes) if prefixes else 1.0)


def templated_prompts() -> list[str]:
    """`PROMPTS` as user turns in the default model's chat template, ready for the answer."""
    from transformers import AutoTokenizer

    from backends.torch.loader import ensure_converted, gguf_source

    source = gguf_source("default")
    assert source is not None
    ensure_converted(*source)
    tokenizer = AutoTokenizer.from_pretrained(source[1])
    return [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
        )
        for p in PROMPTS
    ]


async def answers(endpoint: Endpoint, prompts: list[str], max_tokens: int) -> list[str]:
    """`endpoint`'s greedy completion of every prompt, one at a time."""
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for prompt in prompts:
            body = {
                "model": endpoint.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            response = await client.post(f"{endpoint.url}/completions", json=body)
            response.raise_for_status()
            out.append(response.json()["choices"][0]["text"] or "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", type=named, action="append", default=[], help="NAME=URL")
    parser.add_argument("--carousel", type=named, action="append", default=[], help="NAME=ARGS")
    parser.add_argument("--quantization", action="append", default=[], help="MODE")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", type=Path, default=ROOT / "bench-results" / "agreement")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with servers(args, args.log_dir) as endpoints:
        if len(endpoints) < 2:
            parser.error("give at least two endpoints: the first is the reference")
        prompts = templated_prompts()
        texts = {e.name: asyncio.run(answers(e, prompts, args.max_tokens)) for e in endpoints}
    first = endpoints[0].name
    rows = []
    for endpoint in endpoints[1:]:
        result = agreement(texts[first], texts[endpoint.name])
        rows.append({"endpoint": endpoint.name, "reference": first, **vars(result)})
        print(
            f"{endpoint.name} against {first}: {result.exact}/{result.answers} answers equal, "
            f"mean shared prefix {result.mean_shared_prefix:.2f} of the words"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "answers": texts}, indent=2) + "\n")


if __name__ == "__main__":
    main()
