"""`carousel bench` reads speculative decoding off the iteration trace: the run's drafts and
accepted tokens, vLLM's mean acceptance length in report.json and in the results block, and
nothing of it for an arm that verified no drafts."""

from __future__ import annotations

from typing import Any

import pytest

from bench.summary import results_block
from bench.trace import ArmTrace, trace_summary
from tests.test_bench_trace import it


def verified(i: int, drafts: int, draft_tokens: int, accepted: int) -> dict[str, Any]:
    return {
        **it(i, 1, 2),
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
    }


def test_the_trace_summary_gives_the_mean_acceptance_length() -> None:
    iterations = [it(0, 1, 2), verified(1, 2, 6, 3), it(2, 1), verified(3, 1, 3, 3)]
    summary = trace_summary(ArmTrace(iterations, 4), num_completed=2)
    assert summary["num_verified_steps"] == 2
    assert (summary["num_drafts"], summary["num_draft_tokens"]) == (3, 9)
    assert summary["num_accepted_tokens"] == 6
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)


def test_a_run_without_drafts_has_no_speculation_entries() -> None:
    summary = trace_summary(ArmTrace([it(0, 1), it(1, 1)], 4), num_completed=1)
    assert not {k for k in summary if "draft" in k or "accept" in k}


def run(arm: str, trace: dict[str, Any]) -> dict[str, Any]:
    latency = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    metrics: dict[str, Any] = {
        "completed": 4, "failed": 0, "duration_s": 1.0, "total_input_tokens": 10,
        "total_output_tokens": 20, "request_throughput": 4.0, "output_throughput": 20.0,
        "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency,
    }  # fmt: skip
    return {"arm": arm, "rate": 1.0, "repeat": 0, "metrics": metrics, "errors": {}, "trace": trace}


def test_the_results_block_shows_acceptance_where_an_arm_speculated() -> None:
    spec = trace_summary(ArmTrace([verified(0, 2, 6, 3)], 4), num_completed=1)
    plain = trace_summary(ArmTrace([it(0, 1)], 4), num_completed=1)
    report = {"config": {"repeats": 1}, "runs": [run("plain", plain), run("spec", spec)]}
    lines = results_block(report)
    length = next(line for line in lines if line.startswith("Mean acceptance length"))
    assert length.split()[-2:] == ["-", "2.50"]
    rate = next(line for line in lines if line.startswith("Draft acceptance rate"))
    assert rate.split()[-2:] == ["-", "50%"]
    report["runs"] = [run("plain", plain), run("other", plain)]
    assert not any("acceptance" in line for line in results_block(report))
