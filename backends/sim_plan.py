"""Capacity planning on paper: a model's shape and a GPU's datasheet become the sim's cost
model, and the real schedulers run a Poisson workload against it in virtual time.

Per rank of `n` tensor-parallel ranks (each holds 1/n of the weights and of the KV heads),
the terms of `CostModel` (backends/sim.py) are a roofline, added rather than maxed (an upper
bound that is tight at both ends: decode is all weight reads, long prefills all matmuls):

- `fixed_s`: reading the rank's weights once per step at `hbm_efficiency` of the datasheet
  bandwidth, plus `layer_overhead_s` of kernel launches and synchronisation per layer;
- `per_token_s`: the rank's matmuls, `2 * params / n` FLOPs per scheduled token at `mfu`
  of the datasheet's dense bf16 FLOP/s;
- `per_context_token_s`: reading one cached token's K and V heads of the rank;
- the all-reduces (2 per layer + 1), over the GPU's link (its NCCL bus bandwidth and a
  per-hop latency).

With `pp` pipeline stages each rank holds 1/(tp * pp) of the weights and KV, a step runs the
stages in turn (`CostModel.pipelined_time`), and stages hand activations over the node link
(`STAGE_LINK_LATENCY_S`).

Every number is printed with the result (scripts/plan_tp.py): the answer is only as good as
these assumptions, and scripts/bench_tp.py measures the link terms on a real machine.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass

from backends.byte_tokenizer import EOS_TOKEN_ID
from backends.sim import CostModel, SimBackend
from schedulers import defaults
from schedulers.base import AdmissionError, SchedulerConfig
from schedulers.block_manager import BlockManager
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob

GB = 1e9
#: one stage-to-stage send of a few MB of activations over InfiniBand (HDR, 200 Gb/s per GPU)
STAGE_LINK_LATENCY_S = 20e-6


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a decoder-only model depends on (bf16 weights and KV)."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, all KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Gpu:
    """A datasheet: memory, HBM bandwidth, dense bf16 FLOP/s, and its TP link."""

    name: str
    memory_gb: float
    hbm_gb_s: float
    bf16_tflops: float
    link_gb_s: float  # all-reduce bus bandwidth (NCCL's busbw), per GPU
    link_latency_us: float  # per ring hop


@dataclass(frozen=True)
class Efficiency:
    """How much of the datasheet a real engine gets."""

    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    layer_overhead_s: float = 10e-6
    memory_reserve: float = 0.1  # of each GPU's memory: activations, workspace, fragmentation


def gpt3(name: str, num_layers: int, hidden_size: int, vocab_size: int = 50257) -> ModelShape:
    """A GPT-3-style shape: 12 h^2 weights per layer plus the embedding, heads of 128, MHA."""
    params = 12 * num_layers * hidden_size**2 + vocab_size * hidden_size
    heads = hidden_size // 128
    return ModelShape(name, float(params), num_layers, hidden_size, heads, heads, 128)


MODELS = {
    "gpt3-13b": gpt3("GPT-3-13B", 40, 5120),
    "gpt3-101b": gpt3("GPT-3-101B", 80, 10240),
    "gpt3-175b": gpt3("GPT-3-175B", 96, 12288),
    "gpt3-341b": gpt3("GPT-3-341B", 120, 15360),
    "llama-70b": ModelShape("Llama-3-70B", 70.6e9, 80, 8192, 64, 8, 128),
    "llama-8b": ModelShape("Llama-3-8B", 8.0e9, 32, 4096, 32, 8, 128),
    "smollm2-135m": ModelShape("SmolLM2-135M", 0.135e9, 30, 576, 9, 3, 64),
}
GPUS = {
    # the Orca paper's GPUs (Azure ND96asr A100 v4): 1555 GB/s HBM2, NVLink 3 within a node
    "a100-40gb": Gpu("A100-SXM4-40GB", 40, 1555, 312, 230, 2.0),
    # NVLink 3: 600 GB/s bidirectional per GPU; NCCL all-reduce reaches ~230 GB/s busbw
    "a100-80gb": Gpu("A100-SXM4-80GB", 80, 2039, 312, 230, 2.0),
    # NVLink 4: 900 GB/s bidirectional per GPU; NCCL all-reduce reaches ~360 GB/s busbw
    "h100-80gb": Gpu("H100-SXM5-80GB", 80, 3350, 989, 360, 2.0),
}


def cost_model(
    model: ModelShape, gpu: Gpu, tp: int, eff: Efficiency, pp: int = 1, microbatches: int = 1
) -> CostModel:
    """The sim's per-step cost of `model` over `tp` x `pp` ranks of `gpu` (module docstring)."""
    hbm = gpu.hbm_gb_s * GB * eff.hbm_efficiency
    return CostModel(
        fixed_s=model.weight_bytes / tp / hbm + model.num_layers * eff.layer_overhead_s,
        per_token_s=2 * model.num_params / tp / (gpu.bf16_tflops * 1e12 * eff.mfu),
        per_context_token_s=model.kv_bytes_per_token / tp / hbm,
        tensor_parallel_size=tp,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        activation_bytes=model.dtype_bytes,
        link_latency_s=gpu.link_latency_us * 1e-6,
        link_bandwidth=gpu.link_gb_s * GB,
        pipeline_parallel_size=pp,
        num_microbatches=microbatches,
        stage_link_latency_s=STAGE_LINK_LATENCY_S if pp > 1 else 0.0,
    )


def kv_blocks(
    model: ModelShape, gpu: Gpu, tp: int, block_size: int, eff: Efficiency, pp: int = 1
) -> int:
    """KV blocks that fit: each rank's memory after its weights and the reserve."""
    ranks = tp * pp
    free = gpu.memory_gb * GB * (1 - eff.memory_reserve) - model.weight_bytes / ranks
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {tp} x {pp} x {gpu.name}")
    per_block = model.kv_bytes_per_token / ranks * block_size
    return int(free // per_block)


@dataclass(frozen=True)
class Workload:
    """Poisson arrivals; prompts uniform in a range; outputs lognormal, capped at max_tokens.

    Every request asks `max_tokens` (as clients do) and stops at EOS after its own length, so
    a policy that reserves the worst case (static) reserves `prompt + max_tokens`.
    """

    rate: float = 20.0
    num_requests: int = 2000
    prompt_tokens: tuple[int, int] = (128, 1024)
    output_median: float = 128.0
    output_sigma: float = 0.8
    max_tokens: int = 512
    seed: int = 0
    #: outputs uniform in this range instead (the Orca paper's workload), EOS never early
    output_uniform: tuple[int, int] | None = None

    def requests(self) -> list[tuple[float, int, int]]:
        """(arrival time s, prompt tokens, output tokens) of each request."""
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            t += rng.expovariate(self.rate)
            prompt = rng.randint(*self.prompt_tokens)
            if self.output_uniform is not None:
                out.append((t, prompt, rng.randint(*self.output_uniform)))
                continue
            length = round(rng.lognormvariate(math.log(self.output_median), self.output_sigma))
            out.append((t, prompt, min(self.max_tokens, max(1, length))))
        return out


@dataclass(frozen=True)
class RequestTiming:
    """One job in virtual seconds: when it arrived, its TTFT, end-to-end latency and TPOT."""

    arrival_s: float
    ttft_s: float
    e2e_s: float
    tpot_s: float


@dataclass(frozen=True)
class PlanResult:
    """One policy's run, in virtual seconds."""

    policy: str
    completed: int
    refused: int
    duration_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    tpot_mean_s: float
    mean_batch_size: float
    max_waiting: int
    #: median end-to-end latency per generated token (the Orca paper's normalised latency)
    normalized_latency_p50_s: float = math.nan
    #: each job's own timings, by job (NaN: refused); scripts/rollout_sim.py reads them
    timings: tuple[RequestTiming, ...] = ()

    @property
    def throughput_rps(self) -> float:
        return self.completed / self.duration_s


def _quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


#: the plan models a GPU server as vLLM configures one (its default `max_num_seqs`), not
#: Carousel's CPU engine (schedulers/defaults.py)
GPU_MAX_NUM_SEQS = 256


def simulate(
    policy: str,
    cost: CostModel,
    num_blocks: int,
    jobs: list[tuple[float, int, int]],
    *,
    max_tokens: int = 512,
    block_size: int = defaults.BLOCK_SIZE,
    max_num_seqs: int = GPU_MAX_NUM_SEQS,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 4096,
    options: dict[str, object] | None = None,
    return_with_batch: bool = False,
) -> PlanResult:
    """Run `jobs` ((arrival s, prompt tokens, output tokens), by arrival; each asking
    `max_tokens`) through the `policy` scheduler and the sim backend, in virtual time.
    `options`: the policy's own (static defaults to `batch_wait_ms=0`). `return_with_batch`:
    a finished request's response leaves only once nothing runs (FasterTransformer returns a
    request-level batch whole), so its latency is its batch's."""
    blocks = BlockManager(num_blocks, block_size)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    if policy == "static":
        options = {"batch_wait_ms": 0.0, **(options or {})}
    scheduler = create_scheduler(policy, config, blocks, options)
    clock = 0.0
    scheduler.clock = lambda: clock  # the policy's "now" is virtual time, as arrivals are
    microbatches = getattr(scheduler.options, "num_microbatches", None)
    if microbatches is not None:  # the policy cuts its batches: the backend pipelines them
        cost = dataclasses.replace(cost, num_microbatches=microbatches)
    backend = SimBackend(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, cost=cost
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    eos = frozenset({EOS_TOKEN_ID})
    arrival: dict[int, float] = {}
    target: dict[int, int] = {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    batch_sizes: list[int] = []
    refused = max_waiting = 0
    held: list[int] = []
    next_job = 0
    while next_job < len(jobs) or scheduler.has_work:
        while next_job < len(jobs) and jobs[next_job][0] <= clock:
            at, prompt, length = jobs[next_job]
            seq = Sequence(next_job, f"r{next_job}", [1] * prompt, params, eos_token_ids=eos,
                           arrival_time=at)  # fmt: skip
            try:
                scheduler.add(seq)
            except AdmissionError:
                refused += 1
            arrival[next_job], target[next_job] = at, length
            next_job += 1
        max_waiting = max(max_waiting, len(scheduler.waiting))
        batch = scheduler.schedule() if scheduler.has_work else None
        if batch is None or batch.is_empty:
            if next_job == len(jobs):
                break  # nothing can run and nothing will arrive
            clock = max(clock, jobs[next_job][0])
            continue
        before = backend.virtual_time_s
        output = backend.execute(batch)
        clock += backend.virtual_time_s - before
        for seq in batch.seqs:
            if seq.seq_id in output.sampled and seq.num_output_tokens + 1 >= target[seq.seq_id]:
                output.sampled[seq.seq_id] = TokenLogprob(EOS_TOKEN_ID, 0.0)
        scheduler.update(batch, output)
        batch_sizes.append(len(batch.seqs))
        for seq in batch.seqs:
            if seq.seq_id in output.sampled:
                first.setdefault(seq.seq_id, clock)
                if seq.is_finished:
                    held.append(seq.seq_id)
        if held and (not return_with_batch or not scheduler.running):
            done.update((i, clock) for i in held)
            held.clear()
    ttft = [first[i] - arrival[i] for i in done]
    latency = [done[i] - arrival[i] for i in done]
    tpot = [(done[i] - first[i]) / (target[i] - 1) for i in done if target[i] > 1]
    timings = tuple(
        RequestTiming(
            arrival[i],
            first[i] - arrival[i] if i in done else math.nan,
            done[i] - arrival[i] if i in done else math.nan,
            (done[i] - first[i]) / (target[i] - 1) if i in done and target[i] > 1 else math.nan,
        )
        for i in range(len(jobs))
    )
    return PlanResult(
        policy=policy,
        completed=len(done),
        refused=refused,
        duration_s=clock,
        ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p99_s=_quantile(ttft, 0.99),
        latency_p50_s=_quantile(latency, 0.5),
        latency_p99_s=_quantile(latency, 0.99),
        tpot_mean_s=statistics.fmean(tpot) if tpot else math.nan,
        mean_batch_size=statistics.fmean(batch_sizes) if batch_sizes else 0.0,
        max_waiting=max_waiting,
        normalized_latency_p50_s=statistics.median((done[i] - arrival[i]) / target[i] for i in done)
        if done
        else math.nan,
        timings=timings,
    )
