"""The sim's tensor-parallel cost model and the on-paper planner, on cases with known answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backends.sim import CostModel
from backends.sim_plan import GPUS, MODELS, Efficiency, cost_model, kv_blocks, simulate

REPO = Path(__file__).resolve().parents[1]


def test_ring_all_reduce_time_is_hops_of_latency_plus_bytes_over_the_link() -> None:
    cost = CostModel(tensor_parallel_size=8, link_latency_s=2e-6, link_bandwidth=100e9)
    # 2 (n - 1) = 14 hops; each link carries 2 (n - 1) / n of the message
    assert cost.all_reduce_s(8_000_000) == pytest.approx(14 * 2e-6 + 14 / 8 * 8e6 / 100e9)
    assert CostModel(tensor_parallel_size=1).all_reduce_s(8_000_000) == 0.0


def test_a_tp_step_adds_two_all_reduces_per_layer_and_one_for_the_embedding() -> None:
    one = CostModel(fixed_s=0.01, per_token_s=1e-5, per_context_token_s=1e-8)
    tp = CostModel(fixed_s=0.01, per_token_s=1e-5, per_context_token_s=1e-8,
                   tensor_parallel_size=4, num_layers=10, hidden_size=1024)  # fmt: skip
    message = 32 * 1024 * 2  # 32 tokens x hidden x bf16
    extra = tp.iteration_time(32, 5000) - one.iteration_time(32, 5000)
    assert extra == pytest.approx(21 * tp.all_reduce_s(message))


def test_70b_over_8_gpus_splits_weights_and_kv_heads_by_8() -> None:
    model, gpu = MODELS["llama-70b"], GPUS["h100-80gb"]
    eff = Efficiency()
    one, eight = cost_model(model, gpu, 1, eff), cost_model(model, gpu, 8, eff)
    overhead = model.num_layers * eff.layer_overhead_s
    assert eight.fixed_s - overhead == pytest.approx((one.fixed_s - overhead) / 8)
    assert eight.per_context_token_s == pytest.approx(one.per_context_token_s / 8)
    with pytest.raises(ValueError, match="does not fit"):
        kv_blocks(model, gpu, 1, 16, eff)  # 141 GB of weights on one 80 GB GPU
    assert kv_blocks(model, gpu, 8, 16, eff) > 0


@pytest.mark.parametrize(("policy", "latency_b"), [("orca", 0.015), ("static", 0.095)])
def test_a_short_request_behind_a_long_one_waits_only_under_static(
    policy: str, latency_b: float
) -> None:
    # 10 ms per step whatever runs; A needs 10 steps, B (arriving at 15 ms) needs 1.
    # orca: B joins A's third step (20-30 ms). static: B waits for A's batch (done at 100 ms).
    cost = CostModel(fixed_s=0.01, per_token_s=0.0, per_context_token_s=0.0)
    jobs = [(0.0, 4, 10), (0.015, 4, 1)]
    result = simulate(policy, cost, 64, jobs, max_tokens=16, block_size=4)
    assert result.completed == 2
    assert result.duration_s == pytest.approx(0.100 if policy == "orca" else 0.110)
    latencies = sorted([0.100, latency_b])
    assert result.latency_p50_s == pytest.approx(sum(latencies) / 2)
    assert result.ttft_p50_s == pytest.approx((0.010 + latency_b) / 2)


def test_plan_script_prints_its_assumptions_and_both_policies() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/plan_tp.py", "--requests", "60", "--rate", "5"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    for needle in ("## Assumptions", "8 x H100-SXM5-80GB", "MFU 50%", "161 per step",
                   "Poisson at 5 req/s", "| static | 60 |", "| orca | 60 |"):  # fmt: skip
        assert needle in out, needle
