"""Tensor parallelism on CPU (gloo): TP = 2 greedy outputs equal TP = 1 and HF `generate`.

One group of two ranks serves the whole module (each architecture's backend is loaded into
it and unloaded again). The workload is the oracle's (tests/test_oracle.py): prompts of very
different lengths at staggered times, so orca mixes prefills with decodes and static makes
later arrivals wait, plus one long request aborted after its third token, whose blocks are
then reused by the requests still running and arriving.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.parallel.group import TensorParallelGroup, acquire_group, release_group
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import ARCHITECTURES, BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.base import SchedulerConfig
from schedulers.client import open_stream
from schedulers.engine import Engine
from schedulers.sampling_params import SamplingParams
from tests.test_oracle import DELAYS_S, MAX_TOKENS, hf_greedy, make_backend, prompts

ABORTED_PROMPT = list(range(30, 60))
ABORT_AFTER = 3  # tokens


@pytest.fixture(scope="module")
def group() -> Iterator[TensorParallelGroup]:
    group = acquire_group(2, "cpu")
    yield group
    release_group(group)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    """The architecture's tiny model, and the HF directory it was saved to (safetensors)."""
    model = tiny_model(request.param)
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def expected(saved: tuple[PreTrainedModel, Path]) -> list[list[int]]:
    model, _ = saved
    return [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def tp_backend(
    group: TensorParallelGroup, saved: tuple[PreTrainedModel, Path]
) -> Iterator[TensorParallelBackend]:
    backend = TensorParallelBackend.load(
        str(saved[1]), tensor_parallel_size=2, device="cpu", dtype="float32",
        block_size=BLOCK_SIZE, max_model_len=128, max_num_seqs=64,
    )  # fmt: skip
    yield backend
    backend.close()


async def _collect(
    engine: Engine,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    delay_s: float,
    abort_after: int | None = None,
) -> tuple[list[int], str | None]:
    """(token ids, finish reason) of one greedy request; closed early after `abort_after`."""
    await asyncio.sleep(delay_s)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream = open_stream(engine, request_id, [prompt], params)
    tokens: list[int] = []
    finish = None
    try:
        async for _, out in stream:
            tokens += out.token_ids
            finish = out.finish_reason
            if abort_after is not None and len(tokens) >= abort_after:
                break
    finally:
        stream.close()
    return tokens, finish


def run_with_abort(
    backend: TorchBackend, scheduler: str
) -> tuple[list[list[int]], list[int], Engine]:
    """The staggered workload plus one aborted request: (outputs, aborted tokens, engine)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    engine = Engine(backend, scheduler, config, policy_options={"batch_wait_ms": 20})
    engine.start()

    async def main() -> list[tuple[list[int], str | None]]:
        runs = [
            _collect(engine, f"r{i}", p, m, d)
            for i, (p, m, d) in enumerate(zip(prompts(), MAX_TOKENS, DELAYS_S, strict=True))
        ]
        runs.append(_collect(engine, "aborted", ABORTED_PROMPT, 60, 0.0, ABORT_AFTER))
        return list(await asyncio.wait_for(asyncio.gather(*runs), 120))

    try:
        results = asyncio.run(main())
        deadline = time.monotonic() + 5  # the abort frees its blocks at the next iteration
        while engine.block_manager.num_free_blocks < engine.block_manager.num_blocks:
            assert time.monotonic() < deadline, "KV blocks still held after every request ended"
            time.sleep(0.01)
    finally:
        engine.stop()
    outputs = [tokens for tokens, _ in results[:-1]]
    assert all(finish == "length" for _, finish in results[:-1])
    return outputs, results[-1][0], engine


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_tp2_greedy_equals_tp1_and_hf_generate(
    saved: tuple[PreTrainedModel, Path],
    expected: list[list[int]],
    tp_backend: TensorParallelBackend,
    scheduler: str,
) -> None:
    tp1, tp1_aborted, _ = run_with_abort(make_backend(saved[0]), scheduler)
    tp2, tp2_aborted, engine = run_with_abort(tp_backend, scheduler)
    assert tp2 == expected
    assert tp1 == expected
    assert tp2_aborted == tp1_aborted and len(tp2_aborted) == ABORT_AFTER
    mixed = [r for r in engine.trace if r.num_prefill_tokens and r.num_decode_tokens]
    assert bool(mixed) == (scheduler == "orca")


def test_each_rank_holds_its_own_heads_under_the_same_block_ids(
    tp_backend: TensorParallelBackend,
) -> None:
    ranks = tp_backend.describe()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["num_blocks"] for r in ranks} == {tp_backend.kv_cache_spec.num_blocks}
    # 4 query heads, 2 KV heads, vocabulary 320: each rank holds half of each
    assert [(r["num_heads"], r["num_kv_heads"], r["first_kv_head"]) for r in ranks] == [
        (2, 1, 0),
        (2, 1, 1),
    ]
    assert [r["vocab_rows"] for r in ranks] == [160, 160]


def test_a_size_that_does_not_divide_the_model_is_refused_naming_the_valid_ones(
    saved: tuple[PreTrainedModel, Path],
) -> None:
    before = multiprocessing.active_children()
    with pytest.raises(
        ValueError, match=r"does not divide the 4 attention heads.*valid sizes: 1, 2, 4"
    ):
        TensorParallelBackend.load(str(saved[1]), tensor_parallel_size=3, device="cpu")
    assert multiprocessing.active_children() == before, "a refused size started processes"


def test_a_model_that_is_neither_local_nor_downloadable_is_refused_before_any_process() -> None:
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="not a local one and could not be downloaded"):
        TensorParallelBackend.load("/no/such/model-dir", tensor_parallel_size=2, device="cpu")
    assert multiprocessing.active_children() == before
