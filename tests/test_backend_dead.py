"""A backend that can never run again (`BackendDeadError`) stops its engine for good, with
its reason, whether it fails in a step or tells the engine while idle (`Backend.watch`);
any other step error fails only that step's requests (tests/test_gateway_errors.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backends.sim import SimBackend
from schedulers.backend import BackendDeadError
from schedulers.engine import Engine, EngineDeadError
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from tests.test_engine import all_blocks_free, wait_until

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class WatchedSim(SimBackend):
    """A simulator whose owner can declare it dead, as a tensor-parallel group does."""

    def __init__(self) -> None:
        super().__init__(num_blocks=64, block_size=4)
        self.listeners: list[Callable[[str], None]] = []

    def watch(self, on_dead: Callable[[str], None]) -> None:
        self.listeners.append(on_dead)


def test_dead_backend_in_a_step_stops_the_engine_with_its_reason() -> None:
    backend = SimBackend(num_blocks=64, block_size=4)
    backend.fail_next = BackendDeadError("tensor-parallel rank 1 (pid 7) exited with code -9")
    with LLM(backend, "orca") as llm:
        [gen] = llm.generate([[1, 2, 3]], PARAMS)
        assert gen.choices[0].finish_reason == "error"
        assert gen.choices[0].error == "tensor-parallel rank 1 (pid 7) exited with code -9"
        assert not llm.engine.is_alive
        assert llm.engine.dead_reason == gen.choices[0].error
        assert all_blocks_free(llm.engine)
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.engine.submit("late", [1], PARAMS, lambda _: None)


def test_backend_dying_while_idle_stops_the_engine() -> None:
    backend = WatchedSim()
    engine = Engine(backend, "orca")
    engine.start()
    try:
        assert len(backend.listeners) == 1
        backend.listeners[0]("tensor-parallel group failed: heartbeat timed out")
        wait_until(lambda: not engine.is_alive, timeout=2.0)
        assert engine.dead_reason == "tensor-parallel group failed: heartbeat timed out"
    finally:
        engine.stop()
