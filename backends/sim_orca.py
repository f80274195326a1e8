"""The Orca paper's end-to-end experiment (Yu et al., OSDI '22, section 6) on the sim.

GPT-3 shapes on A100-40GB (backends/sim_plan.py), prompts uniform on [32, 512] tokens,
outputs uniform on [1, 128] with no early EOS, Poisson arrivals at a swept rate; each point is
the median normalised latency (end-to-end latency per generated token) and the throughput.

`static` stands for FasterTransformer: request-level batches of at most `FT_MAX_BATCH_SIZE`,
cut into as many microbatches as there are pipeline stages, and returned whole (a member that
finished early waits for its batch, as the paper describes). `orca` keeps one batch in flight
per pipeline stage (the paper's pipelined iterations); the sim models that as one step over
`pp` microbatches of `ORCA_MAX_BATCH_SIZE` each, whose cost is the same steady pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.sim_plan import GPUS, MODELS, Efficiency, Workload, cost_model, kv_blocks, simulate

#: the paper's FasterTransformer and Orca batch limits (per in-flight batch for Orca)
FT_MAX_BATCH_SIZE = 8
ORCA_MAX_BATCH_SIZE = 8
BLOCK_SIZE = 16
#: the paper's latency line: median normalised latency of 190 ms
LATENCY_TARGET_S = 0.190


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


def run_point(
    setup: Setup,
    policy: str,
    rate: float,
    num_requests: int,
    seed: int = 0,
    max_batch_size: int | None = None,
) -> Point:
    """One Poisson run of `num_requests` through `policy` on `setup`, in virtual time.

    `max_batch_size`: per batch (per in-flight batch for orca); None: the module's default."""
    model, gpu, eff = MODELS[setup.model], GPUS["a100-40gb"], Efficiency()
    cost = cost_model(model, gpu, setup.tp, eff, pp=setup.pp, microbatches=setup.pp)
    blocks = kv_blocks(model, gpu, setup.tp, BLOCK_SIZE, eff, pp=setup.pp)
    workload = Workload(
        rate=rate, num_requests=num_requests, prompt_tokens=(32, 512), max_tokens=128,
        seed=seed, output_uniform=(1, 128),
    )  # fmt: skip
    static = policy == "static"
    if static:
        max_num_seqs = max_batch_size or FT_MAX_BATCH_SIZE
        options: dict[str, object] | None = {"num_microbatches": setup.pp}
    else:
        max_num_seqs, options = (max_batch_size or ORCA_MAX_BATCH_SIZE) * setup.pp, None
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
    max_batch_size: int | None = None,
) -> list[Point]:
    """The latency-throughput curve of `policy`, one point per rate."""
    return [
        run_point(setup, policy, rate, num_requests, max_batch_size=max_batch_size)
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
