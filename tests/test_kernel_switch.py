"""Serve at once on torch's ops while the CPU kernels build, then switch between two steps.

The build itself is not rerun (the kernels are cached where the suite runs): the switch's
`build_kernels` is gated by the test, which opens the gate in the middle of a request.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

import backends.torch.cpu_kernels as cpu_kernels
from backends.torch import kernels
from backends.torch.runner import backend as backend_module
from backends.torch.runner import kernel_switch
from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.kernel_switch import serves_kernels
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_model, tiny_tokenizer
from gateway.arms.local import LocalArm
from gateway.http.routes import LOAD_PHASE_HEADER
from schedulers.base import SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.llm import LLM
from schedulers.load_phase import (
    BUILDING_KERNELS_IN_BACKGROUND,
    KERNELS_BUILDING,
    KERNELS_CAROUSEL,
    KERNELS_TORCH,
    current_load_phase,
)
from schedulers.sampling_params import SamplingParams
from tests.conftest import SIM_MODEL, LiveServer
from tests.kernel_builds import record_compile_phases
from tests.test_oracle import hf_greedy

PROMPT = [5, 17, 200, 3, 99, 41, 7, 250, 12]
MAX_TOKENS = 24
SWITCH_AFTER_STEPS = 6  # the gate opens after this many steps of the request


@pytest.fixture(scope="module", autouse=True)
def built_kernels() -> None:
    if kernels.native() is None:  # the suite's machines build them; say so where they cannot
        pytest.fail(f"these tests switch to Carousel's CPU kernels: {kernels.why_off()}")


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The kernels look unbuilt; the switch's build returns them once the gate opens."""
    opened = threading.Event()

    def gated_build() -> ModuleType | None:
        assert opened.wait(60), "the gate never opened"
        return kernels.native()

    monkeypatch.setattr(backend_module.kernels, "is_built", lambda device_type="cpu": False)
    monkeypatch.setattr(kernel_switch, "build_kernels", gated_build)
    yield opened
    opened.set()


def tiny_backend(**fields: Any) -> TorchBackend:
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return TorchBackend(
        model, tiny_tokenizer(), device="cpu", block_size=BLOCK_SIZE, max_model_len=128,
        max_num_seqs=4, **fields,
    )  # fmt: skip


def generate(backend: TorchBackend, on_step: Callable[[int], None]) -> tuple[list[int], LLM]:
    """One greedy request through the engine, `on_step(n)` called before its n-th step."""
    execute = backend.execute
    steps = iter(range(1, 10_000))

    def counted(batch: Batch) -> ExecuteOutput:
        on_step(next(steps))
        return execute(batch)

    backend.execute = counted  # type: ignore[method-assign]
    llm = LLM(backend, "orca", SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        [generation] = llm.generate([PROMPT], [params])
    finally:
        llm.close()
    return generation.choices[0].token_ids, llm


@pytest.mark.parametrize("model_impl", ["carousel", "transformers"])
def test_a_request_in_flight_keeps_its_greedy_tokens_across_the_switch(
    gate: threading.Event, model_impl: str
) -> None:
    backend = tiny_backend(dtype="float32", kernels_in_background=True, model_impl=model_impl)
    expected = hf_greedy(backend.hf_model, PROMPT, MAX_TOKENS)
    assert backend.serving_kernels == KERNELS_BUILDING
    assert not serves_kernels(backend.model)  # torch's ops: sdpa, oneDNN or F.linear
    assert current_load_phase() is None  # the build is no load phase: /health stays ready
    torch_model = backend.model
    served_by: dict[int, object] = {}

    def on_step(n: int) -> None:
        if n == SWITCH_AFTER_STEPS:
            gate.set()
            switch = backend.kernel_switch
            assert switch is not None and switch.join(60)  # swapped before step n runs
        served_by[n] = backend.model

    with capture_logs() as logs:
        tokens, llm = generate(backend, on_step)
    assert tokens == expected
    assert backend.serving_kernels == KERNELS_CAROUSEL and serves_kernels(backend.model)
    assert served_by[SWITCH_AFTER_STEPS - 1] is torch_model
    assert served_by[SWITCH_AFTER_STEPS] is backend.model is not torch_model
    assert len(served_by) > SWITCH_AFTER_STEPS  # decodes ran on both paths
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    [serving] = [e for e in logs if e["event"] == "cpu_kernels_serving"]
    assert serving["seconds_since_load"] >= 0


def test_the_same_tokens_without_a_switch() -> None:
    backend = tiny_backend(dtype="float32")
    assert backend.kernel_switch is None and backend.serving_kernels == KERNELS_CAROUSEL
    tokens, _ = generate(backend, lambda n: None)
    assert tokens == hf_greedy(backend.hf_model, PROMPT, MAX_TOKENS)


def test_a_failed_build_keeps_torch_serving_and_says_why(
    gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> ModuleType | None:
        raise RuntimeError("g++: internal compiler error")

    monkeypatch.setattr(kernel_switch, "build_kernels", broken)
    with capture_logs() as logs:
        backend = tiny_backend(dtype="float32", kernels_in_background=True)
        switch = backend.kernel_switch
        assert switch is not None and switch.join(30)
    assert backend.serving_kernels == KERNELS_TORCH
    assert switch.failure is not None and "internal compiler error" in switch.failure
    assert [e["why"] for e in logs if e["event"] == "cpu_kernels_background_failed"]
    tokens, _ = generate(backend, lambda n: None)
    assert tokens == hf_greedy(backend.hf_model, PROMPT, MAX_TOKENS)


def test_built_kernels_serve_from_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels are on disk the background setting changes nothing."""
    monkeypatch.setattr(backend_module.kernels, "is_built", lambda device_type="cpu": True)
    backend = tiny_backend(dtype="float32", kernels_in_background=True)
    assert backend.kernel_switch is None and backend.serving_kernels == KERNELS_CAROUSEL


def test_the_build_thread_runs_at_the_lowest_priority(gate: threading.Event) -> None:
    seen: list[int] = []

    def build() -> ModuleType | None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return kernels.native()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_switch, "build_kernels", build)
        backend = tiny_backend(dtype="float32", kernels_in_background=True)
        switch = backend.kernel_switch
        assert switch is not None and switch.join(30)
    assert seen == [kernel_switch.LOWEST_PRIORITY]
    assert backend.serving_kernels == KERNELS_CAROUSEL


def gauge(metrics: str, name: str) -> float:
    """The value of the one `name` series of the served arm in a /metrics text."""
    [line] = [ln for ln in metrics.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_health_metrics_and_the_header_name_the_path_before_and_after(
    gate: threading.Event, make_server: Callable[..., LiveServer]
) -> None:
    backend = tiny_backend(dtype="float32", kernels_in_background=True)
    srv = make_server(LocalArm.from_backend(backend))
    key = f"{SIM_MODEL}/orca"

    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 200  # ready at once: torch's ops serve
    assert health.json() == {"status": "ok", "kernels": {key: KERNELS_BUILDING}}
    assert health.headers[LOAD_PHASE_HEADER] == BUILDING_KERNELS_IN_BACKGROUND
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert gauge(metrics, "carousel_cpu_kernels_serving") == 0
    assert gauge(metrics, "carousel_cpu_kernels_building") == 1
    body = {"model": SIM_MODEL, "prompt": "abc", "max_tokens": 4}
    assert httpx.post(f"{srv.v1}/completions", json=body).status_code == 200
    assert not srv.arm.measurement_ready

    gate.set()
    switch = backend.kernel_switch
    assert switch is not None and switch.join(60)
    health = httpx.get(f"{srv.url}/health")
    assert health.json() == {"status": "ok", "kernels": {key: KERNELS_CAROUSEL}}
    assert LOAD_PHASE_HEADER not in health.headers
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert gauge(metrics, "carousel_cpu_kernels_serving") == 1
    assert gauge(metrics, "carousel_cpu_kernels_building") == 0
    assert httpx.post(f"{srv.v1}/completions", json=body).status_code == 200
    assert srv.arm.measurement_ready


def test_a_background_build_logs_its_progress_but_is_no_load_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_compile_phases(monkeypatch)
    with capture_logs() as logs:
        cpu_kernels._built(tmp_path / "kernels", cpu_kernels.CSRC, "variant", background=True)
    assert seen == [None]  # /health stays 200 while it builds
    assert [e["event"] for e in logs] == ["cpu_kernels_building", "cpu_kernels_building_done"]
    assert logs[0]["background"] is True


def test_is_built_looks_on_disk_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("CAROUSEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.PREBUILT_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_compile", lambda *a: pytest.fail("compiled"))
    assert not cpu_kernels.is_built()
    built = tmp_path / "cpu_kernels" / cpu_kernels._digest() / f"{cpu_kernels.MODULE}.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    assert cpu_kernels.is_built()
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")  # cannot run: native() answers at once
    built.unlink()
    assert cpu_kernels.is_built()
