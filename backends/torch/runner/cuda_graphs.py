"""CUDA graphs for decode-only steps, one per batch-size bucket (vLLM's full decode graphs).

A small model's decode step on a GPU is bound by kernel launches (about 1,200 a SmolLM2 step),
not by memory: replaying one captured graph launches them all at once. A step whose every
sequence computes one token (a decode, or a one-token prefill) of at most the largest
bucket's sequences is padded up to its bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ...,
and `max_num_seqs` itself), staged into the persistent device buffer (staging.py: block
tables `max_blocks_per_seq` wide, padded rows in the scratch KV block) and replayed; the graph
covers embedding to logits and their argmax (used when the whole batch is plain greedy).
Mixed and prefill steps run eager. Graphs are captured at start-up, on the device thread,
after the KV cache is allocated: largest first, all in one memory pool (a smaller graph
reuses the larger one's blocks), with the memory they took logged.

The capture itself is a `Capturer` (`cuda_capturer` on a GPU), so the bucket choice, the
padding and the replay's reading of the static buffers are tested on the CPU with a fake.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from backends.torch.logs import engine_log
from backends.torch.runner.inputs import ModelInput
from backends.torch.runner.staging import InputStager
from schedulers.batch import Batch

log = engine_log("carousel.cuda_graphs")

#: what a graph computes: (logits (P, V), argmax over the vocabulary (P,)), static tensors
StepOutputs = tuple[torch.Tensor, torch.Tensor]


class Graph(Protocol):
    """A captured step: `replay` reruns it on whatever its static input buffers hold now."""

    def replay(self) -> None: ...


#: captures `step` into a graph; returns it and the static tensors it writes its outputs to
Capturer = Callable[[Callable[[], StepOutputs]], tuple[Graph, StepOutputs]]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... (2^k and 1.5 * 2^k), capped
    at `max_num_seqs`, which is always the last."""
    sizes = [1, 2, 4, 8]
    size = 16
    while size < max_num_seqs:
        sizes += [size, size * 3 // 2]
        size *= 2
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def cuda_capturer(device: torch.device) -> Capturer:
    """Captures with `torch.cuda.CUDAGraph`, every graph in one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], StepOutputs]) -> tuple[Graph, StepOutputs]:
        # NOTE: one eager run on a side stream first (cuBLAS workspaces, lazy inits), as
        # torch.cuda.graphs' own make_graphed_callables does
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = step()
        return graph, outputs

    return capture


@dataclass(frozen=True)
class _Captured:
    graph: Graph
    outputs: StepOutputs


class DecodeGraphs:
    """The captured decode steps of one backend and the choice among them."""

    def __init__(
        self,
        stager: InputStager,
        forward: Callable[[ModelInput], torch.Tensor],
        vocab_size: int,
        max_num_seqs: int,
        capture: Capturer,
    ) -> None:
        self.stager = stager
        self.forward = forward
        self.vocab_size = vocab_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.capture = capture
        self.graphs: dict[int, _Captured] = {}
        self.generation = -1  # the stager's buffer generation the graphs read
        self.replays: dict[int, int] = {}  # bucket -> replays (for tests and the GPU check)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding `num_seqs` sequences; None past the largest."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture_all(self) -> None:
        """Capture every bucket, largest first (call on the device thread)."""
        began = time.monotonic()
        before = _device_memory(self.stager.device)
        self.graphs.clear()
        for size in sorted(self.sizes, reverse=True):
            staged = self.stager.stage(Batch(-1), pad_to=size, full_width=True)
            inputs = staged.model_input

            def step(inputs: ModelInput = inputs) -> StepOutputs:
                logits = self.forward(inputs)
                return logits, logits[:, : self.vocab_size].argmax(dim=-1)

            graph, outputs = self.capture(step)
            self.graphs[size] = _Captured(graph, outputs)
        self.generation = self.stager.generation
        log.info(
            "cuda_graphs_captured",
            buckets=len(self.sizes),
            largest=self.sizes[-1],
            memory_mb=round((_device_memory(self.stager.device) - before) / 2**20, 1),
            seconds=round(time.monotonic() - began, 2),
        )

    def run(self, batch: Batch) -> StepOutputs | None:
        """Replay `batch`'s bucket: (logits, argmax) of its real rows; None: run it eager."""
        if any(n != 1 for n in batch.num_scheduled_tokens):
            return None  # mixed and prefill steps run eager
        size = self.bucket_for(len(batch.seqs))
        if size is None:
            return None
        staged = self.stager.stage(batch, pad_to=size, full_width=True)
        if self.generation != self.stager.generation:
            # the device buffer grew (a larger step than ever before): the graphs read the old
            # one, so capture again, then stage this step into the new buffer
            log.warning("cuda_graphs_recapture", reason="the step input buffer grew")
            self.capture_all()
            staged = self.stager.stage(batch, pad_to=size, full_width=True)
        captured = self.graphs[size]
        captured.graph.replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        logits, greedy = captured.outputs
        n = staged.num_seqs  # NOTE: padded rows past it never reach the sampler
        return logits[:n], greedy[:n]


def _device_memory(device: torch.device) -> int:
    """Bytes the caching allocator holds on `device` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_reserved(device))
