"""Static against orca for a big model over tensor-parallel GPUs, on paper (the sim backend).

    python scripts/plan_tp.py [--model llama-70b] [--gpu h100-80gb] [--tp 8] [--rate 20]
        [--requests 2000] [--prompt 128:1024] [--output-median 128] [--max-tokens 512]
        [--mfu 0.5] [--hbm-efficiency 0.8] [--link-gb-s ...] [--link-latency-us ...]

Prints every assumption first (the model's shape, the GPU's datasheet, the efficiencies,
the per-step terms they give, the workload), then one row per policy: the real `static` and
`orca` schedulers and block manager run the workload against the sim's cost model
(backends/sim_plan.py) in virtual time, so a 2000-request hour of an 8-GPU box takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.sim_plan import (  # noqa: E402
    GPUS,
    MODELS,
    Efficiency,
    Workload,
    cost_model,
    kv_blocks,
    simulate,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100-80gb")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt", default="128:1024", help="prompt tokens, uniform LO:HI")
    parser.add_argument("--output-median", type=float, default=128.0)
    parser.add_argument("--output-sigma", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--mfu", type=float, default=Efficiency.mfu)
    parser.add_argument("--hbm-efficiency", type=float, default=Efficiency.hbm_efficiency)
    parser.add_argument(
        "--layer-overhead-us", type=float, default=1e6 * Efficiency.layer_overhead_s
    )
    parser.add_argument("--link-gb-s", type=float, default=None, help="default: the GPU's")
    parser.add_argument("--link-latency-us", type=float, default=None, help="default: the GPU's")
    parser.add_argument("--policies", default="static,orca")
    args = parser.parse_args()

    model = MODELS[args.model]
    gpu = GPUS[args.gpu]
    if args.link_gb_s is not None:
        gpu = dataclasses.replace(gpu, link_gb_s=args.link_gb_s)
    if args.link_latency_us is not None:
        gpu = dataclasses.replace(gpu, link_latency_us=args.link_latency_us)
    eff = Efficiency(args.mfu, args.hbm_efficiency, args.layer_overhead_us * 1e-6)
    lo, hi = (int(x) for x in args.prompt.split(":"))
    workload = Workload(args.rate, args.requests, (lo, hi), args.output_median,
                        args.output_sigma, args.max_tokens)  # fmt: skip
    cost = cost_model(model, gpu, args.tp, eff)
    num_blocks = kv_blocks(model, gpu, args.tp, args.block_size, eff)

    print("## Assumptions")
    print(f"- model: {model.name}, {model.num_params / 1e9:.1f} B params, {model.num_layers} "
          f"layers, hidden {model.hidden_size}, {model.num_heads} heads / {model.num_kv_heads} "
          f"KV heads of {model.head_dim}, bf16 weights and KV")  # fmt: skip
    hardware = [
        f"{args.tp} x {gpu.name}: {gpu.memory_gb:.0f} GB, HBM {gpu.hbm_gb_s:.0f} GB/s,",
        f"{gpu.bf16_tflops:.0f} dense bf16 TFLOP/s each; TP link: all-reduce bus bandwidth",
        f"{gpu.link_gb_s:.0f} GB/s, {gpu.link_latency_us:.1f} us per ring hop",
    ]
    print("- hardware: " + " ".join(hardware))
    print(f"- efficiency: MFU {eff.mfu:.0%}, HBM {eff.hbm_efficiency:.0%} of the datasheet, "
          f"{1e6 * eff.layer_overhead_s:.0f} us launch overhead per layer, "
          f"{eff.memory_reserve:.0%} of memory reserved")  # fmt: skip
    print(f"- per step per rank: {1e3 * cost.fixed_s:.2f} ms fixed (weights), "
          f"{1e6 * cost.per_token_s:.2f} us per scheduled token, "
          f"{1e9 * cost.per_context_token_s:.2f} ns per attended context token")  # fmt: skip
    for tokens in (1, 32, 256, 2048):
        comm = cost.communication_s(tokens) if args.tp > 1 else 0.0
        step = cost.iteration_time(tokens, tokens * (lo + hi) // 2)
        print(f"  - {tokens} tokens: step {1e3 * step:.2f} ms, of which all-reduces "
              f"({2 * model.num_layers + 1} per step) {1e3 * comm:.2f} ms")  # fmt: skip
    print(f"- KV cache: {num_blocks} blocks of {args.block_size} tokens "
          f"({num_blocks * args.block_size:,} tokens) per rank, each rank holding "
          f"{model.num_kv_heads / args.tp:g} of the {model.num_kv_heads} KV heads")  # fmt: skip
    print(f"- workload: {workload.num_requests} requests, Poisson at {workload.rate:g} req/s; "
          f"prompts uniform {lo}-{hi} tokens; outputs lognormal (median "
          f"{workload.output_median:g}, sigma {workload.output_sigma:g}) stopping at EOS, every "
          f"request asking max_tokens={workload.max_tokens}")  # fmt: skip
    print(f"- schedulers: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}; static forms a batch as soon as it is idle "
          "(batch_wait_ms 0) and reserves prompt + max_tokens per member")  # fmt: skip
    print()
    print("## Result (virtual time)")
    print("| policy | done | req/s | TTFT p50 / p99 (s) | latency p50 / p99 (s) | "
          "TPOT (ms) | mean batch | max waiting |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        started = time.perf_counter()
        r = simulate(policy, cost, num_blocks, workload.requests(),
                     max_tokens=workload.max_tokens, block_size=args.block_size,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
        cells = [
            policy,
            str(r.completed),
            f"{r.throughput_rps:.1f}",
            f"{r.ttft_p50_s:.2f} / {r.ttft_p99_s:.2f}",
            f"{r.latency_p50_s:.2f} / {r.latency_p99_s:.2f}",
            f"{1e3 * r.tpot_mean_s:.1f}",
            f"{r.mean_batch_size:.1f}",
            str(r.max_waiting),
        ]
        print("| " + " | ".join(cells) + " |")
        print(f"simulated {policy} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print()
    print(f"Arrivals: {workload.rate:g} req/s. A policy keeps up when its req/s matches the "
          "arrival rate and its latencies stay flat; 'max waiting' growing with --requests means "
          "the queue grows without bound.")  # fmt: skip


if __name__ == "__main__":
    main()
