"""Torch set-up runs on a thread that exits, and every torch forward on one device thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backends.sim import SimBackend
from backends.torch.runner import backend as runner
from backends.torch.runner.device_thread import call_on_own_thread, run_on_device_thread
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from gateway.arms import engine_factory
from gateway.settings.load import Settings
from schedulers.batch import Batch, ExecuteOutput
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams


def _alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def test_result_comes_back_from_a_thread_that_is_gone() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert call_on_own_thread(work, "probe") == 42
    assert seen[0] is not threading.current_thread() and seen[0].name == "probe"
    assert not seen[0].is_alive()


def test_errors_are_raised_on_the_caller_thread() -> None:
    def boom() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        call_on_own_thread(boom, "probe")
    assert not _alive("probe")


def test_load_backend_loads_the_model_off_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded_on: list[str] = []
    original = engine_factory.SharedWeights.get

    def spy(self: engine_factory.SharedWeights) -> object:
        loaded_on.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(engine_factory.SharedWeights, "get", spy)
    backend = engine_factory.load_backend(Settings(model=str(tmp_path), kv_cache_gb=0.01))
    assert loaded_on == ["carousel-load"]
    assert not _alive("carousel-load")
    assert backend.kv_cache_spec.num_blocks > 0
    backend.close()


def test_every_caller_runs_forward_passes_on_one_device_thread() -> None:
    seen: list[int] = []

    def caller() -> None:
        seen.append(run_on_device_thread(threading.get_ident))

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert len(seen) == 3 and len(set(seen)) == 1
    assert threading.get_ident() not in seen
    with pytest.raises(ZeroDivisionError):
        run_on_device_thread(lambda: 1 / 0)


def test_torch_backend_load_loads_off_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_model("qwen2").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded_on: list[str] = []
    original = runner.load_model

    def spy(*args: object, **kwargs: object) -> object:
        loaded_on.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "load_model", spy)
    backend = runner.TorchBackend.load(str(tmp_path), kv_cache_gb=0.01)
    assert loaded_on == ["carousel-load"] and not _alive("carousel-load")
    backend.close()


def test_torch_steps_run_on_the_device_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = runner.TorchBackend(
        tiny_model("llama"), tiny_tokenizer(), device="cpu", kv_cache_gb=0.01, max_model_len=64
    )
    stepped_on: set[str] = set()
    original = backend._execute

    def spy(batch: Batch) -> ExecuteOutput:
        stepped_on.add(threading.current_thread().name)
        return original(batch)

    monkeypatch.setattr(backend, "_execute", spy)
    with LLM(backend) as llm:
        [result] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result.choices[0].token_ids) == 3
    assert len(stepped_on) == 1 and stepped_on.pop().startswith("carousel-device")


def test_the_simulator_steps_on_the_engine_thread() -> None:
    """Only torch work needs the one OpenMP pool; other backends run where they are called."""
    backend = SimBackend(num_blocks=64, block_size=4)
    stepped_on: set[str] = set()
    original = backend.execute

    def spy(batch: Batch) -> ExecuteOutput:
        stepped_on.add(threading.current_thread().name)
        return original(batch)

    backend.execute = spy  # type: ignore[method-assign]
    with LLM(backend) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(stepped_on) == 1 and stepped_on.pop().startswith("carousel-engine")
