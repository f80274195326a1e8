"""Where verifying prompt-lookup drafts pays on this machine: decode steps with and without.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/spec_thresholds.py --rounds 9

(`OMP_NUM_THREADS=1` on a shared machine: with two threads a descheduled one stalls the other
at every barrier and the wall times spread 10x; the ratios are what is compared.)

Loads the default model as `carousel serve` does by default (the torch backend in-process,
`quantization auto`: int4 weights for steps of at most R rows, R measured at load, bf16 above;
a row that verifies k drafts is k + 1 rows, so drafts can push a step past R). Per batch size
B, one batch of B sequences with `--prompt-len`-token prompts decodes in rounds; each round
runs one step per k in 0..max_k in turn (each row's own token plus k random draft tokens;
every step advances each sequence by one token, as a step whose drafts were all rejected
does), so a load spike lands on every k alike. Prints, from the median wall time, the
fastest round's (the least disturbed on a shared machine) and the median process CPU time,
t(B, k), the cost
ratio t(B, k) / t(B, 0), the break-even acceptance (mean accepted drafts per row for the
step to pay: the ratio - 1), the prompt-lookup proposer's time per step over the same rows,
and from them the `max_concurrency` at per-draft acceptance `--acceptance`
(schedulers/spec_decode/thresholds.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench_forward import DecodeBatch  # noqa: E402  (scripts/, on sys.path as the script's folder)

from backends.torch.runner.backend import TorchBackend  # noqa: E402
from schedulers.batch import Batch  # noqa: E402
from schedulers.spec_decode import thresholds  # noqa: E402
from schedulers.spec_decode.ngram import NgramProposer  # noqa: E402

#: how a (B, k) cell's interleaved steps are summed up: (clock, statistic) by name: the median
#: wall time, the fastest round's (the least disturbed by other work, as
#: quantize.measure_max_rows keeps) and the median process CPU time
STATISTICS: dict[str, tuple[str, Callable[[list[float]], float]]] = {
    "median": ("wall", statistics.median),
    "min": ("wall", min),
    "cpu": ("cpu", statistics.median),
}


class DraftingBatch(DecodeBatch):
    """B sequences on `backend`, prefilled (bench_forward's `DecodeBatch`), stepping with k
    random drafts per row."""

    def __init__(self, backend: TorchBackend, rows: int, prompt_len: int, max_steps: int) -> None:
        super().__init__(backend, rows, prompt_len, max_steps + 7)
        self.proposer = NgramProposer(2, 4)

    def step(self, k: int = 0) -> None:
        """One decode step, each row verifying `k` random drafts (0: a plain decode)."""
        batch = Batch(iteration=0)
        for i, seq in enumerate(self.seqs):
            self.block_manager.allocate(seq, seq.num_computed_tokens + 1 + k)
            batch.add(seq, 1)
            if k:
                batch.add_drafts(i, torch.randint(100, 1000, (k,)).tolist())
        out = self.backend.execute(batch)
        for seq in self.seqs:
            emitted = out.verified.get(seq.seq_id) or [out.sampled[seq.seq_id]]
            seq.num_computed_tokens += 1  # every draft rejected: their slots are rewritten
            seq.output_token_ids.append(emitted[0].token_id)

    def propose_s(self, k: int) -> float:
        """Seconds of the proposer's lookup over every row (as the scheduler's step asks)."""
        began = time.perf_counter()
        for seq in self.seqs:
            self.proposer.propose(seq, k)
        return time.perf_counter() - began


def measure(
    backend: TorchBackend, rows: int, max_k: int, rounds: int, prompt_len: int
) -> tuple[dict[str, dict[int, list[float]]], float]:
    """({"wall" | "cpu": k -> each round's step seconds}, median proposer seconds per step)
    at `rows` rows; "cpu" is the process's CPU time (every thread's), which a descheduled
    step does not accrue."""
    run = DraftingBatch(backend, rows, prompt_len, (rounds + 1) * (max_k + 1))
    times: dict[str, dict[int, list[float]]] = {
        clock: {k: [] for k in range(max_k + 1)} for clock in ("wall", "cpu")
    }
    lookups: list[float] = []
    for k in range(max_k + 1):  # one untimed step each
        run.step(k)
    for _ in range(rounds):
        for k in range(max_k + 1):
            began, began_cpu = time.perf_counter(), time.process_time()
            run.step(k)
            times["cpu"][k].append(time.process_time() - began_cpu)
            times["wall"][k].append(time.perf_counter() - began)
        lookups.append(run.propose_s(max_k))
    run.close()
    return times, statistics.median(lookups)


def cpu_model() -> str:
    """`lscpu`'s model name (the platform's processor string where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "Model name" in line]
    return names[0] if names else platform.processor()


def row_line(times: dict[tuple[int, int], float], rows: int, lookup_s: float, p: float) -> str:
    """One B's figures: t(B, 0), each k's cost ratio and break-even, the lookup's time."""
    needed = thresholds.break_even(times)
    base = times[rows, 0]
    cells = [f"t0 {base * 1e3:.1f} ms"]
    ks = sorted(k for b, k in needed if b == rows)
    cells += [f"k={k} x{times[rows, k] / base:.2f} (need {needed[rows, k]:.2f})" for k in ks]
    best, margin = thresholds.best_k(times, rows, p)
    return (
        f"B={rows}: " + "; ".join(cells) + f"; lookup {lookup_s * 1e3:.2f} ms "
        f"({100 * lookup_s / base:.1f}%); best k at p={p}: {best} (gain {margin:.2f})"
    )


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-k", type=int, default=4, help="draft lengths 1..max_k")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved steps per (B, k)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--acceptance", type=float, default=0.8,
        help="per-draft acceptance p behind max_concurrency (default 0.8: the grounded-edit "
        "workload's single stream accepted 66%% of 4 drafts, about p = 0.8)",
    )  # fmt: skip
    parser.add_argument("--quantization", default="auto", help="as `carousel serve` (auto)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    backend = TorchBackend.load(
        "default", kv_cache_gb=0.5, max_num_seqs=max(sizes), quantization=args.quantization
    )
    r = backend.model.quantization.layer_max_rows
    print(f"{cpu_model()}; {backend.model.quantization.mode}, int4 up to R={r} rows", flush=True)
    raw: dict[tuple[int, int], dict[str, list[float]]] = {}
    stats: dict[str, dict[tuple[int, int], float]] = {name: {} for name in STATISTICS}
    lookup: dict[int, float] = {}
    for rows in sizes:
        by_k, lookup[rows] = measure(backend, rows, args.max_k, args.rounds, args.prompt_len)
        raw.update({(rows, k): {c: by_k[c][k] for c in by_k} for k in by_k["wall"]})
        for name, (clock, fn) in STATISTICS.items():
            stats[name].update({(rows, k): fn(t) for k, t in by_k[clock].items()})
            print(f"{name:6} " + row_line(stats[name], rows, lookup[rows], args.acceptance))
        sys.stdout.flush()
    for name, times in stats.items():
        cap = thresholds.max_concurrency(times, args.acceptance)
        at_k = thresholds.max_concurrency(times, args.acceptance, only_k=args.max_k)
        print(
            f"max_concurrency ({name} steps) at per-draft acceptance {args.acceptance}: "
            f"{cap} for the best k, {at_k} for k={args.max_k} (the load switch's)"
        )
    if args.json_out:
        cells = [{"rows": b, "k": k, **t} for (b, k), t in sorted(raw.items())]
        args.json_out.write_text(json.dumps({"R": r, "steps": cells}, indent=1))
    print(f"# command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
