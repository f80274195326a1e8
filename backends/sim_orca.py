"""The Orca paper's end-to-end experiment (Yu et al., OSDI '22, section 6.2) on the sim.

GPT-3 shapes on A100-40GB (backends/sim_plan.py), prompts uniform on [32, 512] tokens,
outputs uniform on [1, 128] with no early EOS, Poisson arrivals at a swept rate; each point is
the median normalised latency (end-to-end latency per generated token) and the throughput.

`static` stands for FasterTransformer as the paper ran it, `ft(max_bs, mbs)`: its custom
scheduler takes up to `max_bs` waiting requests at once, FT cuts the batch into microbatches
of `mbs` requests over the pipeline stages, runs the first step as if every prompt were the
batch's shortest (`align_prompts`) and returns the batch whole. The paper found (1, 1) and
(8, 8) best and plots those (`FT_CONFIGS`). `orca(max_bs)` keeps one batch of up to `max_bs`
in flight per pipeline stage (Algorithm 1's `n_workers` batches); the sim models that as one
step over `pp` microbatches of `max_bs` each, whose cost is the same steady pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from backends.sim import CostModel
from backends.sim_plan import GPUS, MODELS, Efficiency, Workload, cost_model, kv_blocks, simulate

#: the FasterTransformer curves of the paper's figure 10: (max batch size, microbatch size)
FT_CONFIGS = ((1, 1), (8, 8))
#: the Orca curves of figure 10 with batching (orca(1) is also plotted): max batch size
ORCA_MAX_BATCH_SIZES = (8, 16, 32)
BLOCK_SIZE = 16
#: the paper's latency line: median normalised latency of 190 ms
LATENCY_TARGET_S = 0.190
#: FT's step time over the ORCA engine's on 175B, 2 x 8 GPUs, pipelining off: "up to 47%"
#: (the paper's section 6.1 and figure 9c, put down to FT's control messages going through
#: NCCL and the GPU). The sim prices both on one engine; this is the measured upper bound.
FT_ENGINE_SLOWDOWN_175B = 1.47


@dataclass(frozen=True)
class Setup:
    """One of the paper's deployments: a model over tp x pp A100-40GBs."""

    model: str
    tp: int
    pp: int


SETUPS = {
    "101b": Setup("gpt3-101b", 8, 1),
    "175b": Setup("gpt3-175b", 8, 2),
}
#: the paper's headline figures (req/s)
PAPER = {
    ("175b", "static", "at_190ms"): 0.185,
    ("175b", "orca", "at_190ms"): 6.81,
    ("101b", "static", "peak"): 0.49,
}


@dataclass(frozen=True)
class Point:
    """One rate of a sweep."""

    rate: float
    throughput_rps: float
    normalized_latency_s: float


def slower(cost: CostModel, factor: float) -> CostModel:
    """`cost` with every term `factor` times as long (an engine slower than the roofline)."""
    if factor == 1.0:
        return cost
    return dataclasses.replace(
        cost, fixed_s=cost.fixed_s * factor, per_token_s=cost.per_token_s * factor,
        per_context_token_s=cost.per_context_token_s * factor,
        link_latency_s=cost.link_latency_s * factor, link_bandwidth=cost.link_bandwidth / factor,
        stage_link_latency_s=cost.stage_link_latency_s * factor,
    )  # fmt: skip


def run_point(
    setup: Setup,
    policy: str,
    rate: float,
    num_requests: int,
    seed: int = 0,
    max_batch_size: int = 8,
    microbatch_size: int | None = None,
    align_prompts: bool = True,
    step_factor: float = 1.0,
) -> Point:
    """One Poisson run of `num_requests` through `policy` on `setup`, in virtual time.

    static (FT): batches of `max_batch_size` cut into microbatches of `microbatch_size`
    (default: the whole batch), prompts aligned to the shortest when `align_prompts`.
    orca: `max_batch_size` per in-flight batch, one batch per pipeline stage.
    `step_factor`: every step takes this many times the cost model's time (`slower`)."""
    model, gpu, eff = MODELS[setup.model], GPUS["a100-40gb"], Efficiency()
    # orca's step is `pp` microbatches; static's count comes from its options (simulate)
    cost = slower(
        cost_model(model, gpu, setup.tp, eff, pp=setup.pp, microbatches=setup.pp), step_factor
    )
    blocks = kv_blocks(model, gpu, setup.tp, BLOCK_SIZE, eff, pp=setup.pp)
    workload = Workload(
        rate=rate, num_requests=num_requests, prompt_tokens=(32, 512), max_tokens=128,
        seed=seed, output_uniform=(1, 128),
    )  # fmt: skip
    static = policy == "static"
    if static:
        max_num_seqs = max_batch_size
        microbatches = math.ceil(max_batch_size / (microbatch_size or max_batch_size))
        options: dict[str, object] | None = {
            "num_microbatches": microbatches,
            "align_prompts": align_prompts,
        }
    else:
        max_num_seqs, options = max_batch_size * setup.pp, None
    result = simulate(
        policy, cost, blocks, workload.requests(), max_tokens=128, block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs * 640,
        max_model_len=640, options=options, return_with_batch=static,
    )  # fmt: skip
    return Point(rate, result.throughput_rps, result.normalized_latency_p50_s)


def sweep(
    setup: Setup,
    policy: str,
    rates: list[float],
    num_requests: int,
    max_batch_size: int = 8,
    microbatch_size: int | None = None,
    align_prompts: bool = True,
    step_factor: float = 1.0,
) -> list[Point]:
    """The latency-throughput curve of `policy`, one point per rate (`run_point`)."""
    return [
        run_point(
            setup,
            policy,
            rate,
            num_requests,
            max_batch_size=max_batch_size,
            microbatch_size=microbatch_size,
            align_prompts=align_prompts,
            step_factor=step_factor,
        )
        for rate in rates
    ]


def throughput_at(points: list[Point], latency_s: float = LATENCY_TARGET_S) -> float | None:
    """The throughput where the curve crosses `latency_s`, interpolated between the rates
    around it; the last throughput when it never does, None when even the first is over."""
    under = [p for p in points if p.normalized_latency_s <= latency_s]
    if not under:
        return None
    best = max(under, key=lambda p: p.rate)
    above = [p for p in points if p.rate > best.rate and p.normalized_latency_s > latency_s]
    if not above:
        return best.throughput_rps
    nxt = min(above, key=lambda p: p.rate)
    share = (latency_s - best.normalized_latency_s) / (
        nxt.normalized_latency_s - best.normalized_latency_s
    )
    return best.throughput_rps + share * (nxt.throughput_rps - best.throughput_rps)
