"""README.md's A/B example: the verdict lines it shows are what `carousel bench` printed for
the command shown beside them.

The run behind them is kept in docs/bench/readme-ab/report.json. Three ties:

- the README's bench command, read by the CLI's own parser, gives that report's config, every
  field of it (URL, model, arms, request count, lengths, seed, ...);
- the README's verdict block is bench/summary.py's verdict lines for that report, each
  sentence written again by today's bench/verdict.py;
- the same command, run against a simulator with the same arms, prints a verdict with the
  same header and the same metrics in the same order (a metric added to or dropped from the
  verdict fails here).

A change to the command, to the renderer or to the pasted lines fails one of them until the
example is run again and pasted (docs/ab-testing.md, "From a fresh clone to a verdict").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.cli import build_config
from bench.report import _config_entry
from bench.summary import verdict_lines
from bench.verdict import sentence
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.cli import build_parser, main
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, serve_app, sim_arm
from tests.test_docs_commands import carousel_argv, fenced_blocks, joined

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPORT = ROOT / "docs" / "bench" / "readme-ab" / "report.json"


def readme_example(text: str) -> tuple[list[str], list[str]]:
    """(argv after `carousel` of the bench command just above the verdict block, lines of
    that block) in the README's "## A/B" section."""
    section = text.split("\n## A/B", 1)[1].split("\n## ", 1)[0]
    argv: list[str] | None = None
    for _, lines, _ in fenced_blocks(section):
        if lines and lines[0].startswith("Verdict "):
            assert argv is not None, "no bench command above the README's verdict"
            return argv, lines
        for _, line in joined(lines):
            if (words := carousel_argv(line)) is not None and words[:1] == ["bench"]:
                argv = words
    raise AssertionError("no verdict block in the README's A/B section")


def recorded_report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads(REPORT.read_text())
    return report


def test_the_readme_command_is_the_one_behind_the_recorded_run() -> None:
    argv, _ = readme_example(README.read_text())
    args = build_parser().parse_args(argv)
    expected = _config_entry(build_config(args, args.num_requests))
    assert recorded_report()["config"] == expected


def printed_verdict(report: dict[str, Any]) -> list[str]:
    """The verdict lines the bench prints for `report`, its sentences written by today's code."""
    fresh = copy.deepcopy(report)
    for entry in fresh["comparison"]:
        # NOTE: one run per arm, one after the other, is not replicated (bench/verdict.py)
        assert entry["replicated"] is (report["config"]["repeats"] > 1)
        entry["sentence"] = sentence(entry)
    return [line for line in verdict_lines(fresh) if line]


def test_the_readme_verdict_is_what_the_bench_printed_for_that_run() -> None:
    _, shown = readme_example(README.read_text())
    assert shown == printed_verdict(recorded_report())


@pytest.fixture(scope="module")
def sim_carousel() -> Iterator[str]:
    """A Carousel with the arms of examples/ab.yaml, `static` and `orca`, over the simulator."""
    arms = [
        sim_arm(scheduler=name, time_scale=0.01, num_blocks=4096, max_model_len=4096,
                max_num_seqs=16)  # examples/ab.yaml's, room for the byte tokenizer's long prompts
        for name in ("static", "orca")
    ]  # fmt: skip
    app = create_app(
        Settings(backend="sim", served_model_name=SIM_MODEL), [Deployment(SIM_MODEL, arms)]
    )
    with serve_app(app) as url:
        yield url


def as_run_here(argv: list[str], url: str, out: Path) -> list[str]:
    """The README's command against the simulator: its URL, model name and output folder,
    24 requests, no warm-up or progress bar, fewer resamples; every other flag as written."""
    swap = {"--url": f"{url}/v1", "--model": SIM_MODEL, "--out": str(out), "--num-requests": "24"}
    run = [swap.get(prev, word) for prev, word in zip(["", *argv[:-1]], argv, strict=True)]
    return [*run, "--no-progress", "--warmups", "0", "--resamples", "200"]


def verdict_shape(lines: list[str]) -> tuple[str, list[str]]:
    """The header with its numbers and the metric each line is about, in order."""
    labels = [entry["label"] for entry in recorded_report()["comparison"]]
    metrics = [next((x for x in labels if x in line), line) for line in lines[1:]]
    return lines[0], metrics


def test_the_readme_command_prints_a_verdict_of_the_same_shape(
    sim_carousel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, shown = readme_example(README.read_text())
    assert main(as_run_here(argv, sim_carousel, tmp_path / "out")) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("Verdict "))
    end = next((i for i in range(start + 1, len(out)) if not out[i].startswith("  ")), len(out))
    assert verdict_shape(out[start:end]) == verdict_shape(shown)
