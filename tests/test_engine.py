"""The engine loop over the weight-free simulator: streaming, aborts, faults, idling."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.sim import SimBackend
from schedulers.base import AdmissionError
from schedulers.client import generate
from schedulers.engine import Engine, EngineDeadError
from schedulers.llm import LLM
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def all_blocks_free(engine: Engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def stream_all(
    engine: Engine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    """Every output of one request, read through the async client."""
    return [output async for output in generate(engine, request_id, prompt, params)]


def wait_until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_preemption_under_a_tiny_kv_cache_gives_the_same_outputs(scheduler: str) -> None:
    prompts = [[i + 1] * (10 + 7 * i) for i in range(6)]
    with LLM(SimBackend(num_blocks=512, block_size=4), scheduler) as roomy:
        expected = [g.choices[0].text for g in roomy.generate(prompts, GREEDY)]
    with LLM(SimBackend(num_blocks=20, block_size=4), scheduler) as tight:
        got = [g.choices[0].text for g in tight.generate(prompts, GREEDY)]
        assert all_blocks_free(tight.engine)
        if scheduler == "orca":
            assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_every_finish_frees_all_blocks_and_outputs_add_up() -> None:
    with LLM(SimBackend(block_size=4), "orca") as llm:
        gens = llm.generate([[5] * n for n in (1, 30, 7)], SamplingParams(max_tokens=9, n=2))
        assert all_blocks_free(llm.engine)
        assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0
    for gen in gens:
        assert [c.index for c in gen.choices] == [0, 1]
        for choice in gen.choices:
            assert len(choice.token_ids) == 9 and choice.finish_reason == "length"
            assert len(choice.text) == 9  # one ASCII character per simulated token


def test_seeded_choices_reproduce_and_differ_from_each_other() -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, n=2)
    with LLM(SimBackend(), "orca") as llm:
        first, second = llm.generate([[1, 2, 3]], params), llm.generate([[1, 2, 3]], params)
    assert [c.text for c in first[0].choices] == [c.text for c in second[0].choices]
    assert first[0].choices[0].text != first[0].choices[1].text


def test_stop_string_never_leaks_streamed_or_not() -> None:
    backend = SimBackend()
    with LLM(backend, "orca") as llm:
        free = llm.generate([[9, 9]], SamplingParams(max_tokens=64, temperature=0.0))[0]
        text = free.choices[0].text
        stop = text[20:23]
        assert stop.strip() and text.find(stop) >= 20
        cut = text[: text.find(stop)]
        params = SamplingParams(max_tokens=64, temperature=0.0, stop=(stop,))
        deltas = asyncio.run(stream_all(llm.engine, "s", [9, 9], params))
        wait_until(lambda: all_blocks_free(llm.engine))
    assert "".join(d.text for d in deltas) == cut
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"


def test_a_stop_string_ends_the_engines_sequence_too() -> None:
    """The client's side finds the stop string; the engine must hear of it and free the
    sequence's KV at once, not decode on to `max_tokens` (minutes here) for nobody."""
    backend = SimBackend(time_scale=1.0)
    with LLM(backend, "orca") as llm:
        free = llm.generate([[9, 9]], SamplingParams(max_tokens=32, temperature=0.0))[0]
        stop = free.choices[0].text[20:23]
        params = SamplingParams(max_tokens=4000, temperature=0.0, stop=(stop,))
        deltas = asyncio.run(stream_all(llm.engine, "s", [9, 9], params))
        assert deltas[-1].finish_reason == "stop"
        wait_until(lambda: llm.engine.num_running == 0 and all_blocks_free(llm.engine))


def test_async_stream_closed_early_aborts_and_frees_kv() -> None:
    engine = Engine(SimBackend(time_scale=1.0, block_size=4), "orca")
    engine.start()

    async def consume_three() -> None:
        stream = generate(engine, "a", [1] * 40, SamplingParams(max_tokens=500))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        await stream.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(consume_three())
        wait_until(lambda: engine.num_running == 0 and all_blocks_free(engine))
    finally:
        engine.stop()


def test_abort_by_id_ends_the_request_with_abort() -> None:
    engine = Engine(SimBackend(time_scale=1.0), "static")
    engine.start()
    outs: list[RequestOutput] = []
    try:
        engine.submit("x", [1, 2, 3], SamplingParams(max_tokens=1000), outs.append)
        wait_until(lambda: len(outs) >= 2)
        engine.abort("x")
        wait_until(lambda: outs[-1].finished)
        assert outs[-1].finish_reason == "abort"
        wait_until(lambda: all_blocks_free(engine))
    finally:
        engine.stop()


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    backend = SimBackend()
    engine = Engine(backend, "orca")
    engine.start()
    try:
        backend.fail_next = RuntimeError("boom")
        outs: list[RequestOutput] = []
        engine.submit("bad", [1, 2], GREEDY, outs.append)
        wait_until(lambda: outs and outs[-1].finished)
        assert outs[-1].finish_reason == "error" and "boom" in (outs[-1].error or "")
        good: list[RequestOutput] = []
        engine.submit("good", [1, 2], GREEDY, good.append)
        wait_until(lambda: good and good[-1].finished)
        assert good[-1].finish_reason == "length"
        assert all_blocks_free(engine) and engine.is_alive
    finally:
        engine.stop()


def test_a_dead_loop_is_visible_and_refuses_new_requests() -> None:
    engine = Engine(SimBackend(), "orca")
    engine.scheduler.schedule = None  # type: ignore[assignment,method-assign]
    engine.start()
    outs: list[RequestOutput] = []
    engine.submit("a", [1], GREEDY, outs.append)
    wait_until(lambda: outs and outs[-1].finished)
    assert outs[-1].finish_reason == "error"
    assert engine.dead_reason and not engine.is_alive
    with pytest.raises(EngineDeadError):
        engine.submit("b", [1], GREEDY, outs.append)


def test_inadmissible_request_is_refused_synchronously() -> None:
    engine = Engine(SimBackend(num_blocks=4, block_size=4, max_model_len=64), "orca")
    engine.start()
    try:
        with pytest.raises(AdmissionError):
            engine.submit("big", [1] * 10, SamplingParams(max_tokens=10), lambda o: None)
        with pytest.raises(AdmissionError, match="context length"):
            engine.submit("long", [1] * 60, SamplingParams(max_tokens=10), lambda o: None)
    finally:
        engine.stop()


@pytest.mark.usefixtures("no_gc_pauses")
def test_idle_engine_does_not_spin() -> None:
    engine = Engine(SimBackend(), "static", policy_options={"batch_wait_ms": 50})
    engine.start()
    try:
        start_cpu, start = time.process_time(), time.monotonic()
        time.sleep(0.5)
        busy = (time.process_time() - start_cpu) / (time.monotonic() - start)
        assert busy < 0.02, f"idle engine used {busy:.0%} of a core"  # a 0.1 ms poll uses 8%
    finally:
        engine.stop()


def test_stop_ends_in_flight_requests_with_an_error() -> None:
    engine = Engine(SimBackend(time_scale=1.0), "orca")
    engine.start()
    outs: list[RequestOutput] = []
    engine.submit("a", [1], SamplingParams(max_tokens=2000), outs.append)
    wait_until(lambda: len(outs) >= 1)
    engine.stop()
    assert outs[-1].finished and outs[-1].finish_reason == "error"
