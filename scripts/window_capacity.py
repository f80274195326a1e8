"""Issue 50: sequences a KV cache holds at a long context when a model's sliding-window layers
keep only their window's blocks (KV cache groups), against keeping every block.

    .venv/bin/python scripts/window_capacity.py --model gemma-3-270m --kv-gb 1 \
        --context 8192 --dtype bfloat16

Reads the model's config (`resolve_model`: a GGUF is converted once into the cache dir; no
weights are loaded), lays its KV cache out both ways for the same budget in `--dtype` (what
`carousel serve` runs on a CPU; kv_cache.py: a block of every layer, or of one group's
layers), and fills each, through the real block manager, with sequences of `--context`
tokens run as orca runs them (prefill in `--chunk`-token steps, then one decode step, which
drops the blocks behind the window), until the next one no longer fits. Prints both counts
and their ratio.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from transformers import AutoConfig

from backends.torch.kv_cache import GIB, KVLayout, kv_groups
from backends.torch.loader import resolve_model
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence


def sequences_held(layout: KVLayout, budget_bytes: int, context: int, chunk: int) -> int:
    """How many `context`-token sequences a cache of `budget_bytes` laid out as `layout`
    holds, each prefilled in `chunk`-token steps and then decoding (module docstring)."""
    groups = layout.groups
    bm = BlockManager(
        budget_bytes // layout.bytes_per_block,
        layout.block_size,
        windows=() if groups is None else groups.sliding_windows,
    )
    held: list[Sequence] = []
    for seq_id in itertools.count():
        seq = Sequence(seq_id, f"r{seq_id}", [1] * context, SamplingParams(max_tokens=1))
        steps = [min(start + chunk, context) for start in range(0, context, chunk)]
        for target in [*steps, context + 1]:  # the prefill's chunks, then a decode step
            if not bm.can_allocate(seq, target):
                bm.free(seq)
                bm.check_invariants(held)
                return len(held)
            bm.allocate(seq, target)
            seq.num_computed_tokens = min(target, context)
        held.append(seq)
    raise AssertionError("unreachable")


def layer_windows(config: object) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from `layer_types`."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    return [window if kind == "sliding_attention" else None for kind in types]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--kv-gb", type=float, default=1.0)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(resolve_model(args.model)).get_text_config()
    windows = layer_windows(config)
    groups = kv_groups(windows)
    if groups is None:
        raise SystemExit(f"{args.model}: no KV cache groups (layer windows {set(windows)})")
    dtype = getattr(torch, args.dtype)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (len(windows), config.num_key_value_heads, head_dim, args.block_size, dtype)
    budget = int(args.kv_gb * GIB)
    every = sequences_held(KVLayout(*shape), budget, args.context, args.chunk)
    grouped = sequences_held(KVLayout(*shape, groups), budget, args.context, args.chunk)
    sliding = sum(w is not None for w in windows)
    print(
        f"{args.model}: {len(windows)} layers, {sliding} sliding (window {config.sliding_window}),"
        f" {config.num_key_value_heads} KV heads x {head_dim}, {dtype}; KV budget "
        f"{args.kv_gb} GiB; {args.context}-token sequences held: every block kept {every}, "
        f"window blocks only {grouped} ({grouped / max(every, 1):.2f}x)"
    )


if __name__ == "__main__":
    main()
