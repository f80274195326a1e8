"""The verdict in a real bench report: `comparison` entries, sentences, the plot, repeats, SLOs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.cli import build_config, main, register
from bench.fake_server import FakeOptions, fake_server
from bench.metrics import Slo, parse_slo
from tests.test_bench_live import assert_png, bench_args

KEYS = {"metric", "baseline", "arm", "diff", "ci95", "significant", "diff_abs", "ci95_abs"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="carousel")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "--url", "http://h:1", "--model", "m", *argv])


@pytest.mark.parametrize(
    ("text", "slo"),
    [("ttft=2s,tpot=200ms", Slo(2000, 200)), ("tpot=50", Slo(None, 50)),
     ("ttft=1500us", Slo(1.5, None)), (" ttft = 0.5s ", Slo(500, None))],
)  # fmt: skip
def test_slo_flag_syntax(text: str, slo: Slo) -> None:
    assert parse_slo(text) == slo
    assert build_config(parse("--slo", text), 1).slo == slo


@pytest.mark.parametrize("text", ["ttft=2", "e2e=1s", "ttft=2h", "ttft=0", "ttft=1,ttft=2", ""])
def test_bad_slo_is_a_usage_error(text: str) -> None:
    if text == "ttft=2":  # a bare number means milliseconds
        assert parse_slo(text) == Slo(2, None)
        return
    with pytest.raises(SystemExit) as exc:
        parse("--slo", text)
    assert exc.value.code == 2


def test_old_slo_flags_still_work_and_may_not_contradict_the_new_one(tmp_path: Path) -> None:
    assert build_config(parse("--slo-ttft", "500", "--slo-tpot", "50"), 1).slo == Slo(500, 50)
    assert build_config(parse("--slo", "ttft=1s", "--slo-tpot", "50"), 1).slo == Slo(1000, 50)
    args = parse("--slo", "ttft=1s", "--slo-ttft", "500", "--out", str(tmp_path))
    assert main_exit(args) == 2


def main_exit(args: argparse.Namespace) -> int:
    return int(args.func(args))


def test_two_arms_with_repeats_end_in_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(step_s=0.003)) as (url, seen):
        argv = bench_args(url, out, "--arm", "static", "--arm", "orca", "--repeats", "2",
                          "--slo", "ttft=10s,tpot=1s", "--resamples", "300")  # fmt: skip
        assert main(argv) == 0
    # A B then B A: the order flips on the odd repeat; repeat 1 is another workload (seed + 1)
    assert [s["arm"] for s in seen] == ["static"] * 8 + ["orca"] * 16 + ["static"] * 8
    # the 8 requests of a run are sent at once, so they may reach the server in any order
    first = sorted(s["body"]["max_tokens"] for s in seen[:8])
    assert first == sorted(s["body"]["max_tokens"] for s in seen[8:16])
    assert first != sorted(s["body"]["max_tokens"] for s in seen[16:24])
    report = json.loads((out / "report.json").read_text())
    assert [(r["arm"], r["repeat"]) for r in report["runs"]] == [
        ("static", 0), ("orca", 0), ("orca", 1), ("static", 1)
    ]  # fmt: skip
    assert report["config"]["repeats"] == 2 and report["config"]["resamples"] == 300
    entries = {e["metric"]: e for e in report["comparison"]}
    assert list(entries) == [
        "ttft_p50", "ttft_p99", "tpot_p50", "itl_p99", "e2e_p50", "e2e_p99",
        "output_throughput", "goodput",
    ]  # fmt: skip
    for e in entries.values():
        assert set(e) >= KEYS and e["baseline"] == "static" and e["arm"] == "orca"
        assert e["method"].startswith("bootstrap over runs, then requests (paired")
        if e["ci95"] is not None:
            assert e["ci95"][0] <= e["ci95"][1]
            assert e["significant"] == (e["ci95"][0] > 0 or e["ci95"][1] < 0)
    assert entries["goodput"]["baseline_value"] == 1.0  # every request meets 10 s / 1 s
    assert entries["goodput"]["significant"] is False
    assert [r["arm"] for r in report["ratios"]] == ["orca"]
    md = (out / "report.md").read_text()
    verdict = md[md.index("## Verdict") :]
    assert "### orca against static @ inf req/s" in verdict
    assert "One run per arm" not in verdict and all(e["replicated"] for e in entries.values())
    assert all(e["sentence"] in verdict for e in entries.values())
    assert report["files"]["verdict_plots"] == ["comparison.png"]
    assert_png(out / "comparison.png")
    assert "comparison.png" in verdict
    assert {json.loads(line)["repeat"] for line in (out / "requests.jsonl").open()} == {0, 1}


def test_one_arm_has_no_verdict_and_no_slo_means_no_goodput(tmp_path: Path) -> None:
    with fake_server() as (url, _):
        assert main(bench_args(url, tmp_path / "one", "--arm", "orca")) == 0
        assert main(bench_args(url, tmp_path / "two", "--arm", "a", "--arm", "b")) == 0
    one = json.loads((tmp_path / "one" / "report.json").read_text())
    assert (
        one["comparison"] == [] and "## Verdict" not in (tmp_path / "one" / "report.md").read_text()
    )
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    metrics = [e["metric"] for e in two["comparison"]]
    assert "goodput" not in metrics and len(metrics) == 7
    tput = next(e for e in two["comparison"] if e["metric"] == "output_throughput")
    assert tput["ci95"] is None and tput["significant"] is None and "--repeats" in tput["note"]
    # one run each, one after the other: the outcome cannot be told from the run's own shift
    assert {e["outcome"] for e in two["comparison"]} <= {"inconclusive", None}
    assert not any(e["replicated"] for e in two["comparison"])
    assert "**One run per arm**" in (tmp_path / "two" / "report.md").read_text()
    assert any("--slo" in note for note in two["notes"])
