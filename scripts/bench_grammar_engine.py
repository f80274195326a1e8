"""Decode throughput at batch B, every sequence JSON-constrained vs none, side by side.

    .venv/bin/python scripts/bench_grammar_engine.py [--batch-size 32] [--steps 48]
        [--threads N]                                   # step-interleaved (the default)
    .venv/bin/python scripts/bench_grammar_engine.py --engine [--max-tokens 24]
        [--repeats 8] [--scheduler orca] [--temperature 1.0] [--threads N]

The default model; B chat prompts, temperature 1, seeded. The constrained side's schema is
an array of at least 60 objects with a string, a bounded integer and an enum, so no
sequence completes and the batch stays at B; the free side runs with `ignore_eos`.

Default (step-interleaved): two orca schedulers over one block manager and one
TorchBackend, one holding the B constrained sequences and the other the same B prompts
unconstrained. Both are prefilled, then their decode steps alternate (constrained, free,
constrained, ...): each step is `scheduler.schedule()` -> `backend.execute(batch)` (forward,
Sampler with the grammar's fill + apply) -> `scheduler.update` (the matcher accepts), the
engine's own step. Adjacent steps see the same machine load, so the ratio of the median
step times is the comparison least disturbed by other processes.

`--engine`: the whole engine (`LLM` -> Engine thread -> ... -> output processor), the two
batches run one after the other, alternating which goes first, `repeats` times each.
Output tok/s there is B / the median duration of the iterations with no prefill and all B
sequences running (and decode tokens over those iterations' wall time); the ratio is the
median of the per-repeat ratios. Both modes time the grammar step (fill + apply in the
sampler, accept in the scheduler) per decode step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.device_thread import run_on_device_thread
from backends.torch.sample.grammar_mask import GrammarMask
from schedulers.base import Scheduler, SchedulerConfig
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.llm import LLM
from schedulers.outputs import IterationRecord
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from schedulers.structured_output import CompiledGrammar, GrammarSpec, SequenceGrammar

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 60,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["name", "age", "role"],
            },
        }
    },
    "required": ["people"],
}
TOPICS = ["a team", "a city", "a school", "a band", "a club", "a company", "a village", "a ship"]


@dataclasses.dataclass
class Run:
    step_tok_s: float
    wall_tok_s: float
    steps: int
    grammar_ms_per_step: float


class Timer:
    """Accumulates the time spent in wrapped callables (grammar fill+apply, accept)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_records(trace: list[IterationRecord], batch_size: int) -> list[IterationRecord]:
    return [r for r in trace if r.num_prefill_tokens == 0 and r.batch_size == batch_size]


def run_once(
    llm: LLM,
    prompts: list[list[int]],
    grammar: CompiledGrammar | None,
    max_tokens: int,
    temperature: float,
    timer: Timer,
) -> Run:
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
            ignore_eos=grammar is None,
            grammar=grammar,
        )
        for i in range(len(prompts))
    ]
    llm.engine.trace.clear()
    timer.seconds = 0.0
    gens = llm.generate(prompts, params)
    for gen in gens:
        choice = gen.choices[0]
        assert choice.finish_reason == "length", (choice.finish_reason, choice.error)
    records = decode_records(list(llm.engine.trace), len(prompts))
    tokens = sum(r.num_decode_tokens for r in records)
    step = statistics.median(r.duration_s for r in records)
    wall = records[-1].start + records[-1].duration_s - records[0].start
    return Run(len(prompts) / step, tokens / wall, len(records), timer.seconds / len(records) * 1e3)


def steps_interleaved(
    backend: TorchBackend,
    prompts: list[list[int]],
    grammar: CompiledGrammar,
    steps: int,
    timer: Timer,
) -> None:
    """The default mode (see the module docstring)."""
    spec = backend.kv_cache_spec
    block_manager = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
    config = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=8192)
    sides: dict[str, Scheduler] = {}
    for name, constrained in (("constrained", True), ("unconstrained", False)):
        scheduler = create_scheduler("orca", config, block_manager)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(
                max_tokens=steps + 4, temperature=1.0, seed=i, ignore_eos=not constrained
            )
            seq = Sequence(len(sides) * len(prompts) + i, f"{name}-{i}", list(prompt), params)
            if constrained:
                seq.grammar = SequenceGrammar(grammar)
            scheduler.add(seq)
        sides[name] = scheduler

    def step(scheduler: Scheduler) -> tuple[float, float]:
        timer.seconds = 0.0
        start = time.perf_counter()
        batch: Batch = scheduler.schedule()
        scheduler.update(batch, backend.execute(batch))
        return time.perf_counter() - start, timer.seconds

    for scheduler in sides.values():  # prefill (and a first decode), not timed
        step(scheduler)
        step(scheduler)
    times: dict[str, list[float]] = {name: [] for name in sides}
    grammar_s: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(steps):  # alternate, the first side flipping every step pair
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            elapsed, spent = step(sides[name])
            times[name].append(elapsed)
            grammar_s[name].append(spent)
    for scheduler in sides.values():
        assert len(scheduler.running) == len(prompts), "a sequence finished early"
    print(
        f"step-interleaved decode, B={len(prompts)}, {steps} steps per side, temperature 1, "
        f"dtype {backend.dtype}, torch threads {run_on_device_thread(torch.get_num_threads)}"
    )
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name in sides:
        tok_s = len(prompts) / medians[name]
        grammar_ms = statistics.median(grammar_s[name]) * 1e3
        print(
            f"  {name:13s} {tok_s:7.1f} tok/s  (median step {medians[name] * 1e3:.1f} ms, "
            f"mean {statistics.mean(times[name]) * 1e3:.1f} ms, grammar {grammar_ms:.2f} ms/step)"
        )
    print(
        f"  constrained / unconstrained = {medians['unconstrained'] / medians['constrained']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--engine", action="store_true", help="the whole-engine comparison")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per side")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--scheduler", default="orca")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    if args.threads:
        run_on_device_thread(torch.set_num_threads, args.threads)

    backend = TorchBackend.load("default", kv_cache_gb=1.0, max_model_len=512)
    tokenizer = backend.tokenizer
    prompts = []
    for i in range(args.batch_size):
        question = f"List the people of {TOPICS[i % len(TOPICS)]} number {i} as JSON."
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered))
    config = SchedulerConfig(max_num_seqs=args.batch_size, max_num_batched_tokens=4096)

    timer = Timer()
    original_mask = GrammarMask.__call__
    original_advance = Scheduler._advance_grammar
    GrammarMask.__call__ = timer.wrap(original_mask)  # type: ignore[method-assign]
    Scheduler._advance_grammar = staticmethod(timer.wrap(original_advance))  # type: ignore[method-assign]
    if not args.engine:
        with LLM(backend, args.scheduler, config) as llm:
            compiler = llm.engine.grammar_compiler
            assert compiler is not None
            grammar = compiler.submit(GrammarSpec.json_schema(SCHEMA)).result(timeout=60)
            assert isinstance(grammar, CompiledGrammar), grammar
        steps_interleaved(backend, prompts, grammar, args.steps, timer)
        return
    with LLM(backend, args.scheduler, config) as llm:
        compiler = llm.engine.grammar_compiler
        assert compiler is not None
        grammar = compiler.submit(GrammarSpec.json_schema(SCHEMA)).result(timeout=60)
        assert isinstance(grammar, CompiledGrammar), grammar
        run_once(llm, prompts, None, 4, args.temperature, timer)  # warm-up
        run_once(llm, prompts, grammar, 4, args.temperature, timer)
        runs: dict[str, list[Run]] = {"unconstrained": [], "constrained": []}
        for repeat in range(args.repeats):  # interleaved, the order flipping each repeat
            order = [None, grammar] if repeat % 2 == 0 else [grammar, None]
            for g in order:
                name = "unconstrained" if g is None else "constrained"
                runs[name].append(
                    run_once(llm, prompts, g, args.max_tokens, args.temperature, timer)
                )
    print(
        f"engine decode, B={args.batch_size}, {args.scheduler}, temperature {args.temperature}, "
        f"max_tokens {args.max_tokens}, {args.repeats} interleaved repeats, dtype "
        f"{backend.dtype}, torch threads {run_on_device_thread(torch.get_num_threads)}"
    )
    medians = {}
    for name, results in runs.items():
        step = statistics.median(r.step_tok_s for r in results)
        wall = statistics.median(r.wall_tok_s for r in results)
        grammar_ms = statistics.median(r.grammar_ms_per_step for r in results)
        medians[name] = (step, wall)
        print(
            f"  {name:13s} step {step:7.1f} tok/s  wall {wall:7.1f} tok/s  "
            f"(step {args.batch_size / step * 1e3:.1f} ms, grammar {grammar_ms:.2f} ms/step, "
            f"runs step tok/s {[round(r.step_tok_s, 1) for r in results]})"
        )
    pairs = list(zip(runs["unconstrained"], runs["constrained"], strict=True))
    step_ratio = statistics.median(c.step_tok_s / u.step_tok_s for u, c in pairs)
    wall_ratio = statistics.median(c.wall_tok_s / u.wall_tok_s for u, c in pairs)
    print(f"  constrained / unconstrained (median of paired repeats): step {step_ratio:.3f}, "
          f"wall {wall_ratio:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
