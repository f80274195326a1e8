"""A small version of the Orca paper's end-to-end experiment on the sim, and the pipeline cost."""

from __future__ import annotations

import dataclasses

import pytest

from backends.sim import CostModel
from backends.sim_orca import SETUPS, Point, slower, sweep, throughput_at
from backends.sim_plan import GPUS, MODELS, Efficiency, cost_model, kv_blocks, simulate


def test_gpt3_shapes_have_their_papers_sizes() -> None:
    sizes = {"gpt3-13b": 13e9, "gpt3-101b": 101e9, "gpt3-175b": 175e9, "gpt3-341b": 341e9}
    for key, size in sizes.items():
        assert MODELS[key].num_params == pytest.approx(size, rel=0.03)


def test_175b_needs_two_pipeline_stages_of_eight_40gb_gpus() -> None:
    model, gpu, eff = MODELS["gpt3-175b"], GPUS["a100-40gb"], Efficiency()
    with pytest.raises(ValueError, match="does not fit"):
        kv_blocks(model, gpu, 8, 16, eff)
    assert kv_blocks(model, gpu, 8, 16, eff, pp=2) > 0


def test_a_pipeline_without_microbatches_is_no_faster_and_with_them_keeps_stages_busy() -> None:
    whole = CostModel(fixed_s=0.04, per_token_s=1e-4, per_context_token_s=0.0)
    piped = dataclasses.replace(whole, pipeline_parallel_size=2)
    assert piped.iteration_time(8, 0, 8) == pytest.approx(whole.iteration_time(8, 0, 8))
    two = dataclasses.replace(piped, num_microbatches=2)
    # two microbatches: each stage reads its weights twice per step, the stages overlap
    assert two.iteration_time(8, 0, 8) == pytest.approx(2 * (0.02 + 4e-4 / 2))
    assert two.iteration_time(1, 0, 1) == pytest.approx(whole.iteration_time(1, 0, 1))


def test_throughput_at_interpolates_the_crossing() -> None:
    points = [Point(1, 1.0, 0.1), Point(2, 2.0, 0.15), Point(3, 2.5, 0.25)]
    assert throughput_at(points, 0.2) == pytest.approx(2.25)
    assert throughput_at(points, 0.05) is None
    assert throughput_at(points, 1.0) == 2.5


def test_orca_sustains_far_more_than_static_and_static_saturates() -> None:
    setup, n = SETUPS["175b"], 60
    static = sweep(setup, "static", [0.1, 0.2, 0.4, 0.8, 1.6], n, max_batch_size=1)
    orca = sweep(setup, "orca", [0.5, 1.0, 2.0, 4.0, 8.0], n, max_batch_size=8)
    s, o = throughput_at(static), throughput_at(orca)
    assert s is not None and o is not None
    assert o > 5 * s
    # doubling the offered rate past saturation no longer raises static's throughput
    assert static[-1].throughput_rps < 1.15 * static[-2].throughput_rps
    assert static[-1].normalized_latency_s > 3 * static[0].normalized_latency_s


def test_static_returns_a_batch_whole() -> None:
    model, gpu, eff = MODELS["gpt3-13b"], GPUS["a100-40gb"], Efficiency()
    cost = cost_model(model, gpu, 1, eff)
    jobs = [(0.0, 64, 1), (0.0, 64, 100)]  # one batch: a 1-token and a 100-token member
    kw = {"max_tokens": 128, "max_num_seqs": 2, "max_model_len": 256}
    streamed = simulate("static", cost, kv_blocks(model, gpu, 1, 16, eff), jobs, **kw)
    whole = simulate(
        "static", cost, kv_blocks(model, gpu, 1, 16, eff), jobs, return_with_batch=True, **kw
    )
    assert whole.latency_p50_s > 10 * streamed.ttft_p50_s
    assert whole.normalized_latency_p50_s > 5 * streamed.normalized_latency_p50_s


def test_a_policy_sees_virtual_time_not_the_machines_clock() -> None:
    """Arrivals long after this machine booted (time.monotonic) still form batches at once."""
    model, gpu, eff = MODELS["gpt3-13b"], GPUS["a100-40gb"], Efficiency()
    cost = cost_model(model, gpu, 1, eff)
    late = 1e7  # virtual seconds, beyond any uptime
    jobs = [(late, 64, 4), (late + 100.0, 64, 4)]  # each alone in a batch of up to 8
    kw = {"max_tokens": 8, "max_num_seqs": 8, "max_model_len": 256}
    result = simulate("static", cost, kv_blocks(model, gpu, 1, 16, eff), jobs, **kw)
    assert result.completed == 2
    assert result.latency_p50_s < 1.0  # served on arrival, not once a batch of 8 filled


def test_ft_aligned_batches_cost_their_longest_prompt_in_steps() -> None:
    """FT's first step runs every member at the shortest prompt: a short prompt beside a long
    one makes the batch run (long - short) more steps than its outputs need."""
    model, gpu, eff = MODELS["gpt3-13b"], GPUS["a100-40gb"], Efficiency()
    cost = cost_model(model, gpu, 1, eff)
    jobs = [(0.0, 32, 4), (0.0, 512, 4)]
    kw = {"max_tokens": 8, "max_num_seqs": 2, "max_model_len": 640}
    blocks = kv_blocks(model, gpu, 1, 16, eff)
    plain = simulate("static", cost, blocks, jobs, **kw)
    aligned = simulate("static", cost, blocks, jobs, options={"align_prompts": True}, **kw)
    step = cost.iteration_time(2, 0)
    assert aligned.duration_s - plain.duration_s == pytest.approx(480 * step, rel=0.1)


def test_a_slower_engine_scales_every_step() -> None:
    cost = cost_model(MODELS["gpt3-175b"], GPUS["a100-40gb"], 8, Efficiency(), pp=2)
    for tokens, context, seqs in ((1, 300, 1), (8, 4000, 8), (2000, 0, 4)):
        base = cost.iteration_time(tokens, context, seqs)
        assert slower(cost, 1.47).iteration_time(tokens, context, seqs) == pytest.approx(
            1.47 * base
        )
