"""`carousel bench` never measures across a CPU-kernel switch: it waits (up to a deadline)
while an arm's kernels build in the background, and marks a run during which one switched
invalid; `carousel ab report` refuses scrapes in which a compared arm was building."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from backends.sim import SimBackend
from bench.cli import main
from bench.fake_server import FakeOptions, fake_server
from bench.kernels_wait import KernelsNotReady, switched, wait_for_kernels
from bench.prom import building_in, parse_exposition
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.arms.local import LocalArm
from gateway.settings.load import Settings
from schedulers.load_phase import KERNELS_BUILDING, KERNELS_CAROUSEL
from tests.conftest import serve_app
from tests.test_ab_report import MODEL, run, send
from tests.test_bench_live import bench_args

ARM = "toy/orca"


def test_the_bench_refuses_while_an_arm_builds_past_the_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = FakeOptions(kernels={ARM: "building"})
    with fake_server(opts) as (url, seen):
        rc = main(bench_args(url, tmp_path / "out", "--kernels-wait-s", "0.5"))
    assert rc == 1 and seen == [] and opts.probes == []  # nothing was sent
    err = capsys.readouterr().err
    assert "nothing was run" in err and "CPU kernels of toy/orca were still building" in err


def test_the_bench_waits_until_the_kernels_serve(tmp_path: Path) -> None:
    opts = FakeOptions(kernels={ARM: "building"})
    with fake_server(opts) as (url, seen):
        flip = threading.Timer(1.0, lambda: opts.__setattr__("kernels", {ARM: "carousel"}))
        flip.start()
        began = time.monotonic()
        rc = main(bench_args(url, tmp_path / "out", "--kernels-wait-s", "60"))
        flip.join()
    assert rc == 0 and len(seen) == 8
    assert time.monotonic() - began >= 1.0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["kernels"] == {
        "before": {ARM: "carousel"}, "after": {ARM: "carousel"}, "switched": []
    }  # fmt: skip


def test_a_run_across_a_switch_is_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = FakeOptions(kernels={ARM: "torch"}, kernels_mid_run={ARM: "carousel"})
    with fake_server(opts) as (url, _):
        rc = main(bench_args(url, tmp_path / "out"))
    assert rc == 1
    assert (
        "invalid run: it mixed two paths (toy/orca: torch -> carousel)" in capsys.readouterr().err
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["kernels"]["switched"] == ["toy/orca: torch -> carousel"]
    assert any(note.startswith("INVALID") for note in report["notes"])


def test_a_server_without_the_field_is_not_waited_for(tmp_path: Path) -> None:
    with fake_server() as (url, seen):
        assert main(bench_args(url, tmp_path / "out", "--kernels-wait-s", "0")) == 0
    assert len(seen) == 8


def test_the_wait_names_the_arms_and_the_deadline() -> None:
    clock = iter(range(100))
    with pytest.raises(KernelsNotReady, match="a/x, a/y were still building after 3 s"):
        wait_for_kernels(
            lambda: {"a/x": "building", "a/y": "building", "a/z": "carousel"}, 3.0,
            clock=lambda: float(next(clock)), sleep=lambda s: None,
        )  # fmt: skip
    assert switched({"a/x": "carousel"}, {"a/x": "carousel"}) == []


METRICS = """# TYPE carousel_cpu_kernels_building gauge
carousel_cpu_kernels_building{model="m",arm="orca"} %s
carousel_cpu_kernels_building{model="m",arm="static"} 0.0
"""


def test_ab_report_sees_an_arm_building_in_its_scrapes() -> None:
    ready, busy = parse_exposition(METRICS % "0.0"), parse_exposition(METRICS % "1.0")
    assert building_in([ready, busy], "m", ["static", "orca"]) == ["orca"]
    assert building_in([ready], "m", ["static", "orca"]) == []


class BuildingSim(SimBackend):
    """A simulator arm that says its CPU kernels are building (until `ready` is set)."""

    def __init__(self) -> None:
        super().__init__(num_blocks=256, max_model_len=512)
        self.ready = False

    @property
    def serving_kernels(self) -> str | None:
        return KERNELS_CAROUSEL if self.ready else KERNELS_BUILDING


def test_ab_report_refuses_while_a_compared_arm_builds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = BuildingSim()
    arms = [
        LocalArm.from_backend(SimBackend(num_blocks=256, max_model_len=512), name="static"),
        LocalArm.from_backend(backend, name="orca"),
    ]
    app = create_app(Settings(backend="sim", served_model_name=MODEL), [Deployment(MODEL, arms)])
    with serve_app(app) as url:
        send(url, "static", 2)
        send(url, "orca", 2)
        code, out = run("--url", url, "--arm", "static", "--arm", "orca", capsys=capsys)
        assert code == 1
        assert "refused: the CPU kernels of orca were building in the background" in out
        backend.ready = True
        code, out = run("--url", url, "--arm", "static", "--arm", "orca", capsys=capsys)
        assert code == 0, out
