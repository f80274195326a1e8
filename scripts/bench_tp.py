"""Tensor-parallel step time on this machine: TP = 1, 2, 3 side by side, and the all-reduce.

    python scripts/bench_tp.py [--sizes 1,2,3] [--batches 1,8,32] [--repeats 3] [--steps 20]

Part 1 (the engine): a SmolLM2-135M-shaped model with random weights but 12 heads of 48 and
6 KV heads (the real one has 9 heads, so TP = 2 cannot split it; hidden 576, intermediate
1536, vocabulary 49152 and 30 layers are the real ones), fp32 on CPU. For each size N, a
fresh process loads the TP backend and times `execute()` on B decoding sequences in a bare
loop (no scheduler, no HTTP): the median step time over `--steps` steps, and the part of it
rank 0 spends inside the step's collectives (61 all-reduces and the logits gather, timed
around each call: the transfer plus any wait for a slower rank). The sizes run interleaved,
`--repeats` times. Every rank runs one thread (`--threads`): on a small shared machine,
OpenMP barriers across preempted threads would otherwise dominate what is measured.

Part 2 (the collective alone): N processes in a gloo group time `all_reduce` of a
(rows, 576) fp32 tensor, rows from 1 to 2048 (decode batches to prefills), and fit the
ring model of the sim (backends/sim.py): `2 (N - 1)` hops of a latency plus `2 (N - 1) / N`
of the bytes over a bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN = 576
LAYERS = 30
SHAPE = dict(
    vocab_size=49152, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=LAYERS,
    num_attention_heads=12, num_key_value_heads=6, head_dim=48, max_position_embeddings=2048,
    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
PROMPT_LEN = 64
ALLREDUCE_ROWS = [1, 8, 32, 128, 512, 2048]  # a decode batch ... a prefill's tokens


def save_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from backends.torch.testing.tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def step_times(
    model_dir: str, size: int, batch: int, steps: int, threads: int
) -> tuple[list[float], list[float]]:
    """(seconds per decode step, seconds of it inside collectives) of `batch` sequences."""
    import backends.torch.parallel.layers as layers
    from backends.torch.parallel.backend import TensorParallelBackend
    from backends.torch.runner.backend import TorchBackend
    from backends.torch.runner.device_thread import run_on_device_thread
    from schedulers.batch import Batch
    from schedulers.block_manager import BlockManager
    from schedulers.sampling_params import SamplingParams
    from schedulers.sequence import Sequence

    in_collectives = [0.0]

    class TimedDist:
        """torch.distributed as layers.py sees it, timing the collectives on this rank."""

        def __getattr__(self, name: str) -> object:
            op = getattr(dist, name)
            if name not in ("all_reduce", "gather"):
                return op

            def timed(*args: object, **kwargs: object) -> object:
                start = time.perf_counter()
                out = op(*args, **kwargs)
                in_collectives[0] += time.perf_counter() - start
                return out

            return timed

    layers.dist = TimedDist()  # type: ignore[assignment]
    run_on_device_thread(torch.set_num_threads, threads)
    max_model_len = PROMPT_LEN + steps + 8
    backend: TorchBackend
    if size == 1:
        backend = TorchBackend.load(
            model_dir, device="cpu", max_model_len=max_model_len, max_num_seqs=batch
        )
    else:
        backend = TensorParallelBackend.load(
            model_dir, tensor_parallel_size=size, device="cpu", max_model_len=max_model_len,
            max_num_seqs=batch,
        )  # fmt: skip
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(i, f"b{i}", [(7 * i + j) % 1000 for j in range(PROMPT_LEN)], params)
            for i in range(batch)]  # fmt: skip

    def step(n: int) -> tuple[float, float]:
        b = Batch(iteration=0)
        for seq in seqs:
            blocks.allocate(seq, seq.num_computed_tokens + n)
            b.add(seq, n)
        in_collectives[0] = 0.0
        start = time.perf_counter()
        out = backend.execute(b)
        took = time.perf_counter() - start
        for seq in seqs:
            seq.num_computed_tokens += n
            seq.output_token_ids.append(out.sampled[seq.seq_id].token_id)
        return took, in_collectives[0]

    step(PROMPT_LEN)
    timed = [step(1) for _ in range(steps)]
    backend.close()
    return [t for t, _ in timed], [c for _, c in timed]


def _allreduce_rank(rank: int, size: int, port: int, batches: list[int], iters: int,
                    out: str, threads: int) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    result = {}
    for batch in batches:
        x = torch.randn(batch, HIDDEN)
        for _ in range(10):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[batch] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def allreduce_times(size: int, batches: list[int], iters: int = 200) -> dict[int, float]:
    """Median seconds of one all-reduce of (B, hidden) fp32 among `size` gloo ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // size)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "allreduce.json")
        mp.start_processes(_allreduce_rank, (size, port, batches, iters, out, threads),
                           nprocs=size, start_method="spawn")  # fmt: skip
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def child(args: argparse.Namespace) -> None:
    times, collectives = step_times(
        args.model_dir, args.child_size, args.child_batch, args.steps, args.threads
    )
    print(json.dumps([times, collectives]))


def fit_ring(size: int, points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency per hop s, bandwidth bytes/s) of t = 2 (n-1) a + 2 (n-1)/n bytes / b."""
    hops = 2 * (size - 1)
    xs, ys = [hops / size * b for b, _ in points], [t for _, t in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return (my - slope * mx) / hops, (1 / slope if slope > 0 else float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--child-size", type=int, default=0)
    parser.add_argument("--child-batch", type=int, default=0)
    args = parser.parse_args()
    if args.child_size:
        return child(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="carousel-tp-bench-") as scratch:
        model_dir = args.model_dir or scratch
        if not (Path(model_dir) / "config.json").exists():
            save_model(Path(model_dir))
        report(args, sizes, batches, model_dir)


def report(args: argparse.Namespace, sizes: list[int], batches: list[int], model_dir: str) -> None:
    """Run part 1 (interleaved children) and part 2, printing the two tables."""
    medians: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for repeat in range(args.repeats):
        for batch in batches:
            for size in sizes:
                flags = ["--steps", str(args.steps), "--child-batch", str(batch),
                         "--threads", str(args.threads)]  # fmt: skip
                cmd = [sys.executable, __file__, "--model-dir", model_dir, *flags,
                       "--child-size", str(size)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if out.returncode != 0:
                    sys.exit(f"TP={size} B={batch} failed:\n{out.stderr[-3000:]}")
                times, collectives = json.loads(out.stdout.strip().splitlines()[-1])
                run = (statistics.median(times), statistics.median(collectives))
                medians.setdefault((size, batch), []).append(run)
                print(f"repeat {repeat} B={batch} TP={size}: {1e3 * run[0]:.1f} ms, "
                      f"collectives {1e3 * run[1]:.1f} ms", file=sys.stderr)  # fmt: skip
    print("Decode step, ms (median of the runs' medians); in brackets: rank 0's time inside")
    print("the step's collectives")
    print()
    print("| B | " + " | ".join(f"TP = {s}" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for batch in batches:
        cells = []
        for size in sizes:
            runs = medians[size, batch]
            step = 1e3 * statistics.median(r[0] for r in runs)
            comm = 1e3 * statistics.median(r[1] for r in runs)
            cells.append(f"{step:.1f}" + (f" ({comm:.1f})" if size > 1 else ""))
        print(f"| {batch} | " + " | ".join(cells) + " |")
    print()
    print("| ranks | rows (x 576 fp32) | one all-reduce (us) | x 61 (ms) |")
    print("|---|---|---|---|")
    fits = []
    for size in [s for s in sizes if s > 1]:
        ar = allreduce_times(size, ALLREDUCE_ROWS)
        for rows in ALLREDUCE_ROWS:
            us, per_step = 1e6 * ar[rows], (2 * LAYERS + 1) * ar[rows] * 1e3
            print(f"| {size} | {rows} | {us:.0f} | {per_step:.1f} |")
        fits.append((size, *fit_ring(size, [(r * HIDDEN * 4, ar[r]) for r in ALLREDUCE_ROWS])))
    print()
    for size, latency, bandwidth in fits:
        print(f"ring fit, {size} ranks: {1e6 * latency:.0f} us per hop, "
              f"{bandwidth / 1e9:.2f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
