"""What structured outputs cost with the default model (docs/structured-outputs.md).

    .venv/bin/python scripts/bench_grammar.py [--batch-size 32] [--repeats 20]
    .venv/bin/python scripts/bench_grammar.py --decode [--steps 24] [--decode-repeats 3]

Micro costs (default): the TokenizerInfo build; compiling a flat, a nested, a wide schema
and a 3-tool structural tag (cold: a fresh compiler; hit: a cached spec); filling one row's
bitmask along a real JSON output; filling B rows; accepting B tokens; applying B bitmasks
over the whole vocab (ours, and xgrammar's CPU kernel, interleaved); and whether a compile
or a fill holds the GIL (the longest stall of a main-thread loop while one runs).

`--decode` runs the backend's decode loop at batch B (no scheduler, no HTTP, greedy), every
row constrained by the nested schema, against the same loop unconstrained, interleaved: the
bitmask is filled for every row and applied to the logits just before the sampler (wrapped
here; the engine will call the same two functions), and each sampled token is accepted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from backends.torch.loader import resolve_model
from backends.torch.sample.grammar_mask import allocate_bitmask, apply_grammar_bitmask
from gateway.api.outputs.tools import ToolChoice, check_tools, tool_grammar
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarSpec,
    SequenceGrammar,
)
from schedulers.structured_output.compiler import build_tokenizer_info

FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "tags"],
}
NESTED = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "address": {"$ref": "#/$defs/address"},
                "role": {"enum": ["admin", "user", "guest"]},
                "score": {"type": "number", "minimum": -10.5, "maximum": 99.5},
                "friends": {"type": "array", "items": {"$ref": "#/$defs/person"}},
            },
            "required": ["name", "role"],
        },
    },
    "type": "object",
    "properties": {
        "team": {"type": "string"},
        "members": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1},
        "lead": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
    },
    "required": ["team", "members"],
}
WIDE = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(100)},
    "required": [f"field_{i}" for i in range(0, 100, 2)],
}
OUTPUT = json.dumps(
    {
        "team": "Blue",
        "members": [
            {
                "name": "Ada Lovelace",
                "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
                "role": "admin",
                "score": 42.5,
                "friends": [{"name": "Charles", "role": "user"}],
            }
        ],
        "lead": None,
    }
)
TOOLS = [
    {"type": "function", "function": {"name": f"tool_{i}", "parameters": FLAT}} for i in range(3)
]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median wall time of `fn` over `repeats` calls, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def compiled(compiler: GrammarCompiler, spec: GrammarSpec) -> CompiledGrammar:
    result = compiler.compile(spec)
    assert isinstance(result, CompiledGrammar), result
    return result


def max_stall(fn: Callable[[], Any]) -> tuple[float, float]:
    """(duration of `fn` on a thread, longest gap of a busy main-thread loop meanwhile)."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        start = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - start
        done.set()

    thread = threading.Thread(target=run)
    last, gap = time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    thread.join()
    return took[0], gap


def micro(tokenizer: Any, vocab_size: int, batch_size: int, repeats: int) -> None:
    seconds, _ = timed(lambda: build_tokenizer_info(tokenizer, vocab_size, [2]), 3)
    print(f"tokenizer info (special tokens excluded): {seconds * 1e3:.0f} ms")
    tools = check_tools(TOOLS)
    assert isinstance(tools, list)
    tag = tool_grammar(ToolChoice("auto", tuple(tools)))
    assert tag is not None
    specs = {
        "flat": GrammarSpec.json_schema(FLAT),
        "nested": GrammarSpec.json_schema(NESTED),
        "wide-100": GrammarSpec.json_schema(WIDE),
        "3 tools": tag,
    }
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, stop_token_ids=[2])
    for spec in specs.values():  # build each vocabulary once
        compiled(compiler, spec)
    for name, spec in specs.items():
        colds = []
        for _ in range(5):
            fresh = GrammarCompiler(tokenizer, vocab_size=vocab_size, stop_token_ids=[2])
            fresh._infos = compiler._infos  # share the built vocabularies: time the compile
            start = time.perf_counter()
            compiled(fresh, spec)
            colds.append(time.perf_counter() - start)
            fresh.close()
        compiled(compiler, spec)
        hit, _ = timed(lambda spec=spec: compiler.submit(spec).result(), repeats)
        print(
            f"compile {name:9s} cold {statistics.median(colds) * 1e3:6.1f} ms "
            f"(check + compile, submit to result)   cache hit {hit * 1e6:5.1f} us"
        )

    grammar = compiled(compiler, specs["nested"])
    output_ids = tokenizer.encode(OUTPUT)
    bitmask = allocate_bitmask(batch_size, vocab_size)
    walker = SequenceGrammar(grammar)
    per_row = []
    for token_id in output_ids:
        start = time.perf_counter()
        walker.fill_bitmask(bitmask, 0)
        per_row.append(time.perf_counter() - start)
        assert walker.accept(token_id)
    per_row.sort()
    p90 = per_row[int(0.9 * len(per_row))]
    print(
        f"fill one row along a {len(output_ids)}-token output: median "
        f"{statistics.median(per_row) * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, "
        f"max {per_row[-1] * 1e6:.0f} us"
    )

    # B rows at different positions of the output
    positions = [row * len(output_ids) // batch_size for row in range(batch_size)]
    states = []
    for position in positions:
        state = SequenceGrammar(grammar)
        assert state.sync(output_ids[:position])
        states.append(state)

    def fill_all() -> None:
        for row, state in enumerate(states):
            state.fill_bitmask(bitmask, row)

    def accept_all() -> None:
        for state, position in zip(states, positions, strict=True):
            assert state.accept(output_ids[position])
            state.rollback(1)

    fill_s, _ = timed(fill_all, repeats)
    accept_s, _ = timed(accept_all, repeats)
    print(f"fill B={batch_size}: {fill_s * 1e3:.2f} ms   accept+rollback B={batch_size}: "
          f"{accept_s * 1e3:.2f} ms")  # fmt: skip

    import xgrammar as xgr

    logits = torch.randn(batch_size, vocab_size)
    rows = list(range(batch_size))
    times: dict[str, list[float]] = {"ours": [], "xgrammar cpu kernel": []}
    for _ in range(repeats):  # interleaved
        for name in times:
            work = logits.clone()
            start = time.perf_counter()
            if name == "ours":
                apply_grammar_bitmask(work, rows, bitmask)
            else:
                xgr.apply_token_bitmask_inplace(work, bitmask, indices=rows, backend="cpu")
            times[name].append(time.perf_counter() - start)
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"apply B={batch_size} x {vocab_size} ({name}): {median * 1e3:.2f} ms")
    step = fill_s + accept_s / 2 + statistics.median(times["ours"])
    print(
        f"grammar work per decode step at B={batch_size}: {step * 1e3:.2f} ms "
        f"= {step / 0.040:.1%} of a 40 ms step, {step / 0.080:.1%} of an 80 ms step"
    )

    wide = GrammarSpec.json_schema(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}
    )
    took, gap = max_stall(lambda: compiled(compiler, wide))
    print(
        f"GIL: a {took * 1e3:.0f} ms compile stalled the main thread by at most {gap * 1e3:.1f} ms"
    )
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    matchers = [state._matcher for state in states] * 64
    big = allocate_bitmask(len(matchers), vocab_size)
    took, gap = max_stall(lambda: batch.batch_fill_next_token_bitmask(matchers, big))
    print(f"GIL: a {took * 1e3:.0f} ms batch fill of {len(matchers)} rows stalled it by at most "
          f"{gap * 1e3:.1f} ms")  # fmt: skip
    compiler.close()


def decode(batch_size: int, steps: int, repeats: int) -> None:
    from backends.torch.runner.backend import TorchBackend
    from schedulers.batch import Batch
    from schedulers.block_manager import BlockManager
    from schedulers.sampling_params import SamplingParams
    from schedulers.sequence import Sequence

    backend = TorchBackend.load("default", kv_cache_gb=1.0, max_model_len=1024)
    vocab_size = backend.hf_model.config.vocab_size
    compiler = GrammarCompiler(
        backend.tokenizer, vocab_size=vocab_size, stop_token_ids=backend.eos_token_ids
    )
    grammar = compiled(compiler, GrammarSpec.json_schema(NESTED))
    inner = backend.sampler
    spent = {"grammar": 0.0}

    def run(constrained: bool) -> float:
        spec = backend.kv_cache_spec
        bm = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        seqs = [
            Sequence(i, f"b{i}", torch.randint(100, 1000, (64,)).tolist(), params)
            for i in range(batch_size)
        ]
        states = {seq.seq_id: SequenceGrammar(grammar) for seq in seqs}
        bitmask = allocate_bitmask(batch_size, vocab_size)

        def sample(logits: torch.Tensor, batch_seqs: list[Sequence]) -> Any:
            start = time.perf_counter()
            for row, seq in enumerate(batch_seqs):
                states[seq.seq_id].fill_bitmask(bitmask, row)
            apply_grammar_bitmask(logits, list(range(len(batch_seqs))), bitmask)
            spent["grammar"] += time.perf_counter() - start
            return inner(logits, batch_seqs)

        backend.sampler = sample if constrained else inner  # type: ignore[assignment]

        def step(num_tokens: int) -> None:
            b = Batch(iteration=0)
            for seq in seqs:
                bm.allocate(seq, seq.num_computed_tokens + num_tokens)
                b.add(seq, num_tokens)
            out = backend.execute(b)
            start = time.perf_counter()
            for seq in seqs:
                seq.num_computed_tokens += num_tokens
                token = out.sampled[seq.seq_id].token_id
                seq.output_token_ids.append(token)
                if constrained:
                    state = states[seq.seq_id]
                    assert state.accept(token)
                    if state.is_terminated:  # keep every row constrained: start again
                        states[seq.seq_id] = SequenceGrammar(grammar)
            if constrained:
                spent["grammar"] += time.perf_counter() - start

        step(64)
        start = time.perf_counter()
        for _ in range(steps):
            step(1)
        elapsed = time.perf_counter() - start
        for seq in seqs:
            bm.free(seq)
            inner.release(seq.seq_id)
        backend.sampler = inner
        return batch_size * steps / elapsed

    run(False), run(True)  # warm-up
    results: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    spent["grammar"] = 0.0
    for _ in range(repeats):  # interleaved
        results["unconstrained"].append(run(False))
        results["constrained"].append(run(True))
    free, bound = (
        statistics.median(results["unconstrained"]),
        statistics.median(results["constrained"]),
    )
    per_step = spent["grammar"] / (repeats * (steps + 1))
    print(f"decode B={batch_size}, {steps} steps x {repeats} interleaved repeats, greedy, "
          f"dtype={backend.dtype}, torch threads={torch.get_num_threads()}")  # fmt: skip
    print(f"  unconstrained {free:7.1f} tok/s  (step {batch_size / free * 1e3:.1f} ms)")
    print(f"  constrained   {bound:7.1f} tok/s  (grammar work {per_step * 1e3:.2f} ms / step)")
    print(f"  constrained / unconstrained = {bound / free:.3f}  (runs: {results})")
    compiler.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decode", action="store_true", help="the decode-loop comparison")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--decode-repeats", type=int, default=3)
    args = parser.parse_args()
    if args.decode:
        decode(args.batch_size, args.steps, args.decode_repeats)
        return
    model_dir = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(f"{model_dir}/config.json") as config:
        vocab_size = json.load(config)["vocab_size"]
    micro(tokenizer, vocab_size, args.batch_size, args.repeats)


if __name__ == "__main__":
    main()
