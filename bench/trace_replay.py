"""A public trace (bench/public_traces.py) as the requests to send and when.

Rows from `start_s` seconds into the trace on (`--replay-start`), at most `max_requests` of
them, keep their arrival offsets from the first row kept, times `time_scale`. Each asks for
exactly its trace's lengths: a prompt of `input_len` tokens (bench/exact_prompts.py, Mooncake's
blocks shared by hash id) and `max_tokens = output_len`, sent with `ignore_eos` where the arm
accepts it (the probe finds out). ShareGPT rows carry their own prompt text and no times: they
arrive at `rate` (bench/workload.py's arrivals).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from bench.exact_prompts import PromptCost, block_prompt, exact_prompt
from bench.public_traces import TraceFormat, TraceRequest
from bench.replay import ReplayWorkload
from bench.workload import RequestSpec, arrival_offsets


def select_rows(
    rows: list[TraceRequest], start_s: float = 0.0, max_requests: int | None = None
) -> list[TraceRequest]:
    """The rows at or after `start_s` (rows without a time are all kept), the first
    `max_requests` of them."""
    kept = [r for r in rows if r.arrival_s is None or r.arrival_s >= start_s]
    return kept[:max_requests] if max_requests else kept


def trace_workload(
    rows: list[TraceRequest],
    fmt: TraceFormat,
    cost: PromptCost,
    *,
    time_scale: float = 1.0,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    seed: int = 0,
) -> ReplayWorkload:
    """The specs and send times of `rows` (see the module docstring)."""
    text_rng = np.random.default_rng([seed, 8])
    specs = []
    for i, row in enumerate(rows):
        if row.prompt is not None:
            prompt = row.prompt
        elif row.hash_ids:
            prompt = block_prompt(row.hash_ids, row.input_len or 1, cost, seed)
        else:
            prompt = exact_prompt(text_rng, row.input_len or 1, cost)
        specs.append(RequestSpec(i, row.output_len, prompt=prompt, target_input_len=row.input_len))
    times = [r.arrival_s for r in rows]
    if rows and all(t is not None for t in times):
        first = times[0] or 0.0
        offsets = [max(0.0, ((t or 0.0) - first) * time_scale) for t in times]
    else:
        offsets = arrival_offsets(len(rows), rate, burstiness, seed)
    shared = Counter(h for r in rows for h in r.hash_ids or ())
    info: dict[str, Any] = {
        "format": fmt,
        "num_records": len(rows),
        "time_scale": time_scale,
        "span_s": offsets[-1] if offsets else 0.0,
        "prompt_tokens_per_word": cost.per_word,
        "prompt_fixed_tokens": cost.fixed,
        "exact_prompt_lengths": cost.measured and not any(r.prompt for r in rows),
        "shared_blocks": sum(1 for n in shared.values() if n > 1),
        "endpoints": {},
        "skipped": {},
    }
    return ReplayWorkload(specs, offsets, info)
