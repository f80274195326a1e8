"""A first start says what it is doing: the load phases in `/health`, and their log lines."""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from structlog.testing import capture_logs

import backends.torch.cpu_kernels as cpu_kernels
import backends.torch.loader as loader
from backends.sim import SimBackend
from backends.torch.progress import reported_phase
from gateway.arms.local import LocalArm
from gateway.http.routes import LOAD_PHASE_HEADER
from schedulers.load_phase import (
    BUILDING_KERNELS,
    CONVERTING_MODEL,
    LOADING_MODEL,
    WAITING_FOR_KERNELS,
    current_load_phase,
    load_phase,
)
from tests.conftest import CHAT, LiveServer, error_of
from tests.kernel_builds import record_compile_phases


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_health_names_the_phase_while_the_model_loads(
    make_server: Callable[..., LiveServer],
) -> None:
    entered, release = threading.Event(), threading.Event()

    def load() -> SimBackend:
        with (
            load_phase(LOADING_MODEL, "loading the model 'default'"),
            load_phase(BUILDING_KERNELS, "building the CPU kernels, once"),
        ):
            entered.set()
            release.wait(20)
        return SimBackend()

    srv = make_server(LocalArm("slow", load), wait_ready=False)
    try:
        assert entered.wait(10)
        health = httpx.get(f"{srv.url}/health")
        error = error_of(health, 503)  # the body keeps OpenAI's error shape exactly
        assert error["code"] == "model_loading"
        assert "the model is loading: building the CPU kernels, once (" in error["message"]
        assert "s so far)" in error["message"]
        assert health.headers[LOAD_PHASE_HEADER] == BUILDING_KERNELS
        busy = error_of(httpx.post(f"{srv.v1}/chat/completions", json=CHAT), 503)
        assert "building the CPU kernels" in busy["message"]
    finally:
        release.set()
    wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200)
    assert LOAD_PHASE_HEADER not in httpx.get(f"{srv.url}/health").headers
    assert current_load_phase() is None


def test_the_innermost_phase_is_current_and_the_outer_one_returns() -> None:
    assert current_load_phase() is None
    with load_phase(LOADING_MODEL, "loading"):
        with load_phase(CONVERTING_MODEL, "converting") as inner:
            assert current_load_phase() is inner
        phase = current_load_phase()
        assert phase is not None and phase.name == LOADING_MODEL
    assert current_load_phase() is None


def test_a_slow_phase_logs_its_start_progress_and_end() -> None:
    counts = iter(range(100))
    with (
        capture_logs() as logs,
        reported_phase(
            BUILDING_KERNELS,
            "building",
            "things_building",
            every_s=0.05,
            progress=lambda: {"objects_built": next(counts)},
        ),
    ):
        time.sleep(0.3)
    events = [entry["event"] for entry in logs]
    assert events[0] == "things_building" and events[-1] == "things_building_done"
    progress = [entry for entry in logs if entry["event"] == "things_building_progress"]
    assert len(progress) >= 2, events
    assert [p["objects_built"] for p in progress] == list(range(len(progress)))
    assert progress[-1]["elapsed_s"] >= 0
    assert logs[-1]["seconds"] >= 0.3


def test_a_gguf_conversion_is_a_reported_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        seen.append(current_load_phase())
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with capture_logs() as logs:
        loader.ensure_converted(gguf, tmp_path / "cache" / "m")
        loader.ensure_converted(gguf, tmp_path / "cache" / "m")  # cached: no second phase
    assert [p.name if p else None for p in seen] == [CONVERTING_MODEL]
    events = [entry["event"] for entry in logs]
    assert events == ["model_converting", "model_converting_done"]


def test_a_kernel_build_and_the_wait_for_another_ones_are_reported_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_compile_phases(monkeypatch)
    build_dir = tmp_path / "kernels"
    build_dir.mkdir()
    with (build_dir / "carousel.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is building
        builder = threading.Thread(
            target=cpu_kernels._built, args=(build_dir, cpu_kernels.CSRC, "variant")
        )
        builder.start()
        wait_until(lambda: current_load_phase() is not None)
        phase = current_load_phase()
        assert phase is not None and phase.name == WAITING_FOR_KERNELS
        fcntl.flock(held, fcntl.LOCK_UN)
    builder.join(10)
    assert [p.name if p else None for p in seen] == [BUILDING_KERNELS]
    assert current_load_phase() is None


def test_kernels_built_ahead_are_imported_without_building_or_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's case: no compiler on PATH, the module built ahead (found by `make
    compose-smoke`, where a check for the compiler came before the look for it)."""
    digest = "0123456789abcdef"
    ahead = tmp_path / "prebuilt" / digest / f"{cpu_kernels.MODULE}.so"
    ahead.parent.mkdir(parents=True)
    ahead.write_bytes(b"")
    imported: list[Path] = []

    def fake_import(path: Path, name: str) -> ModuleType:
        imported.append(path)
        module = ModuleType(name)
        module.__file__ = str(path)
        module.amx_built = lambda: False  # type: ignore[attr-defined]
        module.set_amx_min_rows = lambda rows: 0  # type: ignore[attr-defined]
        return module

    def no_build(*_: object) -> ModuleType:
        raise AssertionError("built although a prebuilt module was there")

    monkeypatch.setattr(cpu_kernels, "_digest", lambda csrc=cpu_kernels.CSRC: digest)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda _: None)  # no c++, no g++
    monkeypatch.setattr(cpu_kernels, "_import", fake_import)
    monkeypatch.setattr(cpu_kernels, "_built", no_build)
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx2")
    monkeypatch.setenv(cpu_kernels.PREBUILT_ENV, str(tmp_path / "prebuilt"))
    with capture_logs() as logs:
        assert cpu_kernels._build() is not None
    assert imported == [ahead]
    assert [entry["event"] for entry in logs] == ["cpu_kernels_ready"]
