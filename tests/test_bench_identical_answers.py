"""The bench reports the share of greedy answers each arm gave exactly as the baseline did
(bench/answers.py), and says "not comparable" where the requests were not greedy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.answers import answer_agreement, comparable_requests
from bench.cli import main
from bench.client import RequestResult, RunOutcome
from bench.fake_server import FakeOptions, fake_server
from bench.runner import BenchResult, RunRecord
from bench.workload import RequestSpec
from tests.test_bench_live import bench_args


def run(arm: str, texts: list[str], repeat: int = 0) -> RunRecord:
    results = [
        RequestResult(index=i, max_tokens=4, success=True, text=t) for i, t in enumerate(texts)
    ]
    outcome = RunOutcome(results, start_wall=0.0, end_wall=1.0, duration_s=1.0, interrupted=False)
    return RunRecord(arm, arm, 1.0, outcome, {}, repeat=repeat, num_requests=len(texts))


def entry(runs: list[RunRecord], specs: list[RequestSpec]) -> dict[str, Any]:
    (only,) = answer_agreement(BenchResult(runs, interrupted=False), ["a", "b"], specs)
    return only


SPECS = [RequestSpec(index=i, max_tokens=4, prompt=f"p{i}") for i in range(4)]


def test_identical_answers_are_counted_per_request_over_repeats() -> None:
    runs = [
        run("a", ["x", "y", "z", "w"]),
        run("b", ["x", "y", "Z", "w"]),
        run("b", ["x", "y", "z", "w"], repeat=1),
        run("a", ["x", "y", "z", "W"], repeat=1),
    ]
    got = entry(runs, SPECS)
    assert (got["identical"], got["compared"], got["share"]) == (6, 8, 0.75)
    assert got["not_comparable"] is None


def test_a_failed_request_is_not_compared() -> None:
    runs = [run("a", ["x", "y", "z", "w"]), run("b", ["x", "y", "z", "w"])]
    runs[1].results[3].success = False
    got = entry(runs, SPECS)
    assert (got["identical"], got["compared"], got["share"]) == (3, 3, 1.0)


@pytest.mark.parametrize(
    ("specs", "why"),
    [
        ([RequestSpec(index=0, max_tokens=4, body={"temperature": 0.7})], "temperature 0"),
        ([RequestSpec(index=0, max_tokens=4, body={})], "temperature 0"),  # OpenAI's default: 1
        ([RequestSpec(index=0, max_tokens=4, body={"temperature": 0, "n": 2})], "temperature 0"),
        ([RequestSpec(index=0, max_tokens=4, prompt="p", turn=2)], "resends an earlier answer"),
    ],
)
def test_requests_that_are_not_greedy_on_one_prompt_are_not_comparable(
    specs: list[RequestSpec], why: str
) -> None:
    indices, reason = comparable_requests(specs)
    assert not indices and reason is not None and why in reason
    got = entry([run("a", ["x"]), run("b", ["x"])], specs)
    assert got["share"] is None and got["compared"] == 0


def test_the_bench_own_requests_sampled_at_a_temperature_are_not_comparable() -> None:
    assert comparable_requests(SPECS) == ({0, 1, 2, 3}, None)
    indices, reason = comparable_requests(SPECS, temperature=0.8)
    assert not indices and reason is not None and "temperature 0" in reason


def bench_report(tmp_path: Path, opts: FakeOptions) -> dict[str, Any]:
    out = tmp_path / "out"
    with fake_server(opts) as (url, _):
        assert main(bench_args(url, out, "--arm", "static", "--arm", "orca")) == 0
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    assert "## Identical greedy answers" in (out / "report.md").read_text()
    return report


def test_the_bench_reports_every_answer_identical_for_arms_that_answer_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = bench_report(tmp_path, FakeOptions(step_s=0.002))
    (got,) = report["identical_answers"]
    assert (got["arm"], got["baseline"], got["identical"], got["compared"]) == (
        "orca", "static", 8, 8
    )  # fmt: skip
    assert "scheduling alone" in got["sentence"]
    assert "identical to static's on 8/8 (100%)" in capsys.readouterr().out


def test_the_bench_reports_the_share_of_answers_that_differ(tmp_path: Path) -> None:
    report = bench_report(tmp_path, FakeOptions(step_s=0.002, answer_changes={"orca": 4}))
    (got,) = report["identical_answers"]
    assert (got["identical"], got["compared"], got["share"]) == (6, 8, 0.75)
    assert "computed differently" in got["sentence"]
