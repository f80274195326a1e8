"""KV memory: paged allocation (Carousel's orca) against reserving max tokens up front.

    python scripts/kv_capacity.py [--kv-gb 0.25] [--requests 256] [--max-tokens 256]

A heavy-tailed workload (prompts uniform 32-256 tokens; each request asks max_tokens=256 but
actually stops, at EOS, after a lognormal number of tokens with median 48) is queued at once.
With the default model's KV geometry (30 layers, 3 KV heads x 64 dims, fp32: 46 KiB per
token) and a fixed KV budget, it reports:
- reserve-max: how many sequences fit when each reserves prompt + max_tokens up front (the
  Orca paper's scheme, and our `static` scheduler's);
- paged (orca): the mean (over iterations while requests still queue) and peak number of
  sequences running concurrently when blocks are allocated as tokens arrive, with
  preemption when they run out;
- the paged waste: allocated but unused slots, at most block_size - 1 per running sequence.
Runs the real schedulers over a weight-free backend, in seconds.
"""

from __future__ import annotations

import argparse
import random

from backends.sim import SimBackend
from schedulers.base import SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, layers, kv heads, head dim, fp32
EOS = 0


def workload(n: int, max_tokens: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [
        (rng.randint(32, 256), min(max_tokens, max(1, round(rng.lognormvariate(3.87, 1.0)))))
        for _ in range(n)
    ]


def run(policy: str, num_blocks: int, block_size: int, jobs: list[tuple[int, int]],
        max_tokens: int) -> dict[str, float]:  # fmt: skip
    bm = BlockManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 20, max_model_len=4096)
    sched = create_scheduler(policy, config, bm)
    targets = {}
    for i, (prompt, out) in enumerate(jobs):
        seq = Sequence(i, f"r{i}", [1] * prompt, SamplingParams(max_tokens=max_tokens),
                       eos_token_ids=frozenset({EOS}))  # fmt: skip
        targets[i] = out
        sched.add(seq)
    running: list[int] = []
    waste, first_batch, iterations = 0.0, None, 0
    while sched.has_work:
        iterations += 1
        batch: Batch = sched.schedule()
        if first_batch is None:
            first_batch = len(batch.seqs)
        sampled = {}
        for i, seq in enumerate(batch.seqs):
            if batch.samples_after(i):
                done = seq.num_output_tokens + 1 >= targets[seq.seq_id]
                sampled[seq.seq_id] = TokenLogprob(EOS if done else 5, 0.0)
        slots = sum(len(s.block_table) for s in sched.running) * block_size
        used = sum(s.num_computed_tokens + n for s, n in
                   zip(batch.seqs, batch.num_scheduled_tokens, strict=True))  # fmt: skip
        if sched.running:
            waste = max(waste, (slots - used) / len(sched.running))
        if sched.waiting:  # steady state: the queue still has work for free seats
            running.append(len(sched.running))
        sched.update(batch, ExecuteOutput(sampled))
    assert bm.num_free_blocks == num_blocks
    return {
        "first_batch": float(first_batch or 0),
        "mean_running": sum(running) / len(running),
        "peak_running": float(max(running)),
        "iterations": float(iterations),
        "max_waste_slots_per_seq": waste,
        "preemptions": float(sched.num_preemptions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv-gb", type=float, default=0.25)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    _ = SimBackend  # the schedulers here are the real ones; no backend needed
    slots = int(args.kv_gb * 2**30) // BYTES_PER_TOKEN
    num_blocks = slots // args.block_size
    jobs = workload(args.requests, args.max_tokens, args.seed)
    mean_need = sum(p + o for p, o in jobs) / len(jobs)
    print(f"KV budget {args.kv_gb} GiB = {slots} token slots = {num_blocks} blocks of "
          f"{args.block_size}; mean actual need {mean_need:.0f} tokens/request")  # fmt: skip
    static = run("static", num_blocks, args.block_size, jobs, args.max_tokens)
    orca = run("orca", num_blocks, args.block_size, jobs, args.max_tokens)
    print(f"reserve-max (prompt + {args.max_tokens}): {static['first_batch']:.0f} sequences fit "
          f"at once; {static['iterations']:.0f} iterations for the queue")  # fmt: skip
    print(f"paged (orca): mean {orca['mean_running']:.1f} (while requests queue), peak "
          f"{orca['peak_running']:.0f} concurrent sequences; {orca['iterations']:.0f} iterations; "
          f"{orca['preemptions']:.0f} preemptions")  # fmt: skip
    print(f"paged waste: at most {orca['max_waste_slots_per_seq']:.1f} slots per running "
          f"sequence (block size {args.block_size})")  # fmt: skip
    print(f"concurrency gain: {orca['mean_running'] / static['first_batch']:.2f}x mean, "
          f"{orca['peak_running'] / static['first_batch']:.2f}x peak")  # fmt: skip


if __name__ == "__main__":
    main()
