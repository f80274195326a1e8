"""The CUDA-graph runner's logic on the CPU, with a fake graph (runner/cuda_graphs.py).

The fake captures like a CUDA graph does: its outputs are static tensors, and a replay reruns
the captured step on whatever the static input buffers hold then (the closure holds the
staged views of capture time, not the step's). So a replay that read stale or misplaced
inputs, a wrong bucket, or a padded row reaching the sampler, changes the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedModel

from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.cuda_graphs import Capturer, Graph, StepOutputs, graph_batch_sizes
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.base import SchedulerConfig
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams
from tests.test_oracle import MAX_TOKENS, hf_greedy, prompts, run_engine


class FakeGraph:
    def __init__(self, step: Callable[[], StepOutputs], outputs: StepOutputs) -> None:
        self.step, self.outputs = step, outputs

    def replay(self) -> None:
        for static, fresh in zip(self.outputs, self.step(), strict=True):
            static.copy_(fresh)


def fake_capture(step: Callable[[], StepOutputs]) -> tuple[Graph, StepOutputs]:
    outputs = tuple(t.clone() for t in step())
    assert len(outputs) == 2
    return FakeGraph(step, (outputs[0], outputs[1])), (outputs[0], outputs[1])


class GraphedBackend(TorchBackend):
    """A CPU backend that "captures" its decode steps with the fake."""

    def _graph_capturer(self) -> Capturer | None:
        return fake_capture


def make(model: PreTrainedModel, cls: type[TorchBackend], **fields: Any) -> TorchBackend:
    return cls(
        model, tiny_tokenizer(), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=128, max_num_seqs=8, attention_backend="sdpa", cpu_kernels=False,
        **fields,
    )  # fmt: skip


def test_buckets() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_replayed_decodes_match_hf_generate(arch: str) -> None:
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    backend = make(model, GraphedBackend)
    graphs = backend.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    outputs, _ = run_engine(backend, "orca", config)
    assert outputs == expected
    assert sum(graphs.replays.values()) > 10
    assert len(graphs.replays) >= 2  # several buckets, padded ones among them (3 sequences)


def test_sampled_rows_equal_the_eager_backend() -> None:
    """Seeded sampling, penalties and logprobs through replayed steps give the eager output.

    NOTE: the tokens are equal; logprobs to float rounding, as a graph's attention runs over
    block tables `max_blocks_per_seq` wide (masked), the eager one over the batch's widest.
    """
    model = tiny_model("qwen2")
    model.generation_config.eos_token_id = None
    params = [
        SamplingParams(max_tokens=m, temperature=0.9, top_p=0.8, seed=i, ignore_eos=True,
                       logprobs=2 if i % 2 else None, presence_penalty=0.3 * (i % 3))
        for i, m in enumerate(MAX_TOKENS)
    ]  # fmt: skip
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=256)

    def run(backend: TorchBackend) -> list[Any]:
        with LLM(backend, "orca", config) as llm:
            gens = llm.generate(prompts(), params)
        return [c for g in gens for c in g.choices]

    graphed = make(model, GraphedBackend)
    got, want = run(graphed), run(make(model, TorchBackend))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            values = [x.logprob, *(v for _, v in x.top)]
            expected = [y.logprob, *(v for _, v in y.top)]
            assert values == pytest.approx(expected, rel=1e-4, nan_ok=True)
    assert graphed.graphs is not None and graphed.graphs.replays


def test_the_cpu_and_enforce_eager_never_capture() -> None:
    model = tiny_model("llama")
    assert make(model, TorchBackend).graphs is None
    assert make(model, TorchBackend, enforce_eager=True).graphs is None
