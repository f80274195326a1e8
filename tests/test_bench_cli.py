"""`carousel bench` command line: registration, flags, URL handling, usage errors."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import api_base, build_config, register, run

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="carousel")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "--url", "http://h:1", "--model", "m", *argv])


def test_register_adds_bench_with_run_as_func() -> None:
    args = parse()
    assert args.command == "bench" and args.func is run
    assert args.arm == [] and args.endpoint == "chat" and args.rate == math.inf
    assert str(args.input_len) == "orca" and str(args.output_len) == "orca"
    assert args.ignore_eos is True and args.warmups == 1 and args.num_requests is None


def test_all_flags_parse_into_the_config(tmp_path: Path) -> None:
    args = parse(
        "--arm", "static", "--arm", "orca", "--arm", "static", "--endpoint", "completions",
        "--api-key", "sk", "--sweep-rates", "1,2,inf", "--burstiness", "0.5",
        "--input-len", "fixed:64", "--output-len", "heavy-tail", "--seed", "7",
        "--max-concurrency", "16", "--slo-ttft", "500", "--slo-tpot", "50",
        "--out", str(tmp_path), "--timeout", "30", "--no-ignore-eos", "--no-trace",
    )  # fmt: skip
    cfg = build_config(args, num_requests=10)
    assert cfg.arms == ["static", "orca"]
    assert cfg.rates == [1.0, 2.0, math.inf] and cfg.burstiness == 0.5
    assert cfg.client.api_base == "http://h:1/v1" and cfg.client.endpoint == "completions"
    assert cfg.client.api_key == "sk" and cfg.client.max_concurrency == 16
    assert cfg.client.timeout_s == 30 and cfg.client.ignore_eos is False
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (500, 50)
    assert cfg.out_dir == tmp_path and cfg.fetch_trace is False and cfg.seed == 7


def test_no_arm_means_no_arm_header() -> None:
    assert build_config(parse(), 1).arms == [None]


@pytest.mark.parametrize(
    ("url", "base"),
    [("http://h:8000", "http://h:8000/v1"), ("http://h:8000/", "http://h:8000/v1"),
     ("http://h:8000/v1/", "http://h:8000/v1"), ("https://x/openai/v1", "https://x/openai/v1")],
)  # fmt: skip
def test_api_base_appends_v1_only_to_a_bare_host(url: str, base: str) -> None:
    assert api_base(url) == base


@pytest.mark.parametrize(
    "argv",
    [["--input-len", "gauss:3"], ["--rate", "0"], ["--sweep-rates", ""], ["--burstiness", "0"],
     ["--num-requests", "0"], ["--endpoint", "embeddings"], ["--warmups", "-1"]],
)  # fmt: skip
def test_bad_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2


def test_unreadable_dataset_exits_2(tmp_path: Path) -> None:
    args = parse("--dataset", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))
    assert run(args) == 2


def test_module_entry_point_and_no_torch_import() -> None:
    code = (
        "import sys, runpy; sys.argv = ['x', '--help']\n"
        "try:\n    runpy.run_module('bench', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "import bench.report, bench.plots\n"
        "assert 'torch' not in sys.modules, 'the bench must not import torch'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "--sweep-rates" in proc.stdout and "--slo-ttft" in proc.stdout


def test_vllm_bench_flags_are_aliases(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="carousel")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["bench", "--num-prompts", "7", "--request-rate", "3", "--result-dir", str(tmp_path),
         "--seed", "5", "--base-url", "http://h:9"]
    )  # fmt: skip
    assert (args.num_requests, args.rate, args.out, args.seed) == (7, 3.0, tmp_path, 5)
    assert args.url == "http://h:9"
    assert parser.parse_args(["bench", "--max-requests", "4"]).num_requests == 4


def test_the_url_defaults_to_a_local_carousel() -> None:
    parser = argparse.ArgumentParser(prog="carousel")
    register(parser.add_subparsers(dest="command", required=True))
    assert api_base(parser.parse_args(["bench"]).url) == "http://127.0.0.1:8000/v1"
