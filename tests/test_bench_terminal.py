"""`carousel bench` tells the answer in the terminal: the probe's causes, the results block,
the verdict against the baseline, and an endpoint that refuses ignore_eos."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backends.upstream import UpstreamConfig
from bench.cli import main
from bench.fake_server import FakeOptions, fake_server
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, LiveServer, serve_app, sim_arm


@pytest.fixture(scope="module")
def carousel() -> Iterator[str]:
    """A Carousel serving SIM_MODEL with the arms `static` and `orca` (sim backend)."""
    arms = [
        sim_arm(scheduler="static", time_scale=0.01),
        sim_arm(scheduler="orca", time_scale=0.01),
    ]
    app = create_app(
        Settings(backend="sim", served_model_name=SIM_MODEL), [Deployment(SIM_MODEL, arms)]
    )
    with serve_app(app) as url:
        yield url


def bench(url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--url", url, "--num-prompts", "8", "--input-len", "fixed:16",
        "--output-len", "uniform:2:12", "--result-dir", str(out), "--no-progress",
        "--warmups", "0", "--resamples", "200", *extra,
    ]  # fmt: skip


def assert_answer_in(stdout: str, arms: list[str], completed: int) -> None:
    """The results block (one column per arm, the baseline's first) and the verdict."""
    assert "Serving Benchmark Result" in stdout
    header = next(line for line in stdout.splitlines() if line.strip().startswith(arms[0]))
    assert header.split() == arms
    ok = next(line for line in stdout.splitlines() if line.startswith("Requests ok / failed"))
    assert re.findall(r"(\d+) / (\d+)", ok) == [(str(completed), "0")] * len(arms)
    for title in ("Time to First Token", "Time per Output Token", "Inter-token Latency"):
        assert title in stdout
    assert len(re.findall(r"^P(50|90|99) ", stdout, re.MULTILINE)) == 9
    assert "Output token throughput (tok/s)" in stdout
    baseline, candidate = arms[0], arms[1]
    verdict = stdout.split(f"what {candidate} buys against {baseline} (the baseline)", 1)
    assert len(verdict) == 2, stdout
    sentences = [  # a note that both arms ran the same schedule may follow (a loaded machine)
        s for s in verdict[1].splitlines()[1:] if s.startswith("  ") and "note:" not in s
    ]
    assert len(sentences) == 8  # seven metrics and goodput (an --slo was given)
    assert any("95% CI" in s or "90% CI" in s for s in sentences)


def test_the_answer_is_printed_for_a_carousel_and_the_model_found_alone(
    carousel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bench(carousel, tmp_path, "--arm", "static", "--arm", "orca", "--slo", "ttft=10s")
    assert main(argv) == 0  # no --model: the one model /v1/models lists
    stdout = capsys.readouterr().out
    assert_answer_in(stdout, ["static", "orca"], 8)
    assert "Goodput (req/s)" in stdout and "Requests meeting --slo" in stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["model"] == SIM_MODEL
    assert report["config"]["ignore_eos_refused"] == []


def test_the_answer_is_printed_for_another_openai_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_server() as (url, seen):
        argv = bench(url, tmp_path, "--model", "toy", "--arm", "static", "--arm", "orca",
                     "--slo", "ttft=10s,tpot=1s", "--request-rate", "400")  # fmt: skip
        assert main(argv) == 0
    assert len(seen) == 16
    assert_answer_in(capsys.readouterr().out, ["static", "orca"], 8)


def test_the_answer_is_printed_for_a_local_arm_against_an_upstream_carousel(
    make_server: Callable[..., LiveServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = make_server(sim_arm(scheduler="orca", time_scale=0.01))
    here = sim_arm(scheduler="static", time_scale=0.01)
    here.name = "static"
    upstream = UpstreamArm("remote", UpstreamConfig(base_urls=(remote.v1,), model=SIM_MODEL))
    upstream.weight = 0.0
    upstream.pinnable = True
    app = create_app(
        Settings(backend="sim", served_model_name="front"),
        [Deployment("front", [here, upstream])],
    )
    with serve_app(app) as url:
        argv = bench(url, tmp_path, "--arm", "static", "--arm", "remote", "--slo", "ttft=10s")
        assert main(argv) == 0
    assert_answer_in(capsys.readouterr().out, ["static", "remote"], 8)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["model"] == "front"
    assert [r["metrics"]["completed"] for r in report["runs"]] == [8, 8]


def test_an_endpoint_refusing_ignore_eos_is_adapted_to_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = FakeOptions(refuse_ignore_eos=True)
    with fake_server(opts) as (url, seen):
        argv = bench(url, tmp_path, "--model", "toy", "--arm", "static", "--arm", "orca",
                     "--slo", "ttft=10s")  # fmt: skip
        assert main(argv) == 0
    captured = capsys.readouterr()
    assert "refuses ignore_eos" in captured.err and "without it" in captured.err
    assert len(seen) == 16 and not any("ignore_eos" in s["body"] for s in seen)
    assert_answer_in(captured.out, ["static", "orca"], 8)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["ignore_eos_refused"] == ["static", "orca"]


def test_a_404_names_the_served_models(
    carousel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(bench(carousel, tmp_path, "--model", "smollm2", "--arm", "static")) == 1
    err = capsys.readouterr().err
    assert "probe request failed" in err and "HTTP 404" in err
    assert f"the server serves: {SIM_MODEL}" in err
    assert not (tmp_path / "report.json").exists()


def test_a_400_gives_the_server_message(
    carousel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(bench(carousel, tmp_path, "--arm", "static", "--arm", "nosuch")) == 1
    err = capsys.readouterr().err
    assert "arm nosuch: HTTP 400" in err and "nosuch" in err.split("HTTP 400", 1)[1]


def test_a_run_where_nothing_succeeded_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_server(FakeOptions(fail_every=1)) as (url, _):
        assert main(bench(url, tmp_path, "--model", "toy")) == 1
    captured = capsys.readouterr()
    assert "no request succeeded: HTTP 500: boom" in captured.err
    assert "errors of default: 8 x HTTP 500: boom" in captured.out


def test_a_missing_bench_extra_is_caught_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now raises ImportError
    opts = FakeOptions()
    with fake_server(opts) as (url, seen):
        assert main(bench(url, tmp_path, "--model", "toy")) == 2
    err = capsys.readouterr().err
    assert "no scipy" in err and "pip install 'carousel-serve[bench]'" in err
    assert seen == [] and opts.probes == []
