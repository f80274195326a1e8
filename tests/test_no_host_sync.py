"""A decode step's forward asks the host nothing: no `.item()`, no `nonzero`, no boolean-mask
indexing, no op whose output shape depends on tensor data, no copy between devices.

Each of those makes a GPU step wait for the device (and none can be in a CUDA graph). The
check is a `TorchDispatchMode` around the forward of the path a GPU runs (the eager layers,
`sdpa` attention, torch's own kernels: Carousel's CPU kernels are a CPU-only path and are
left out), from the staged inputs to the logits and their argmax. On the CPU every tensor is
on one device, so the copy check is shown to work on a copy to the `meta` device.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import ARCHITECTURES, BLOCK_SIZE, tiny_model, tiny_tokenizer
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence

aten = torch.ops.aten
#: ops that read a tensor's data on the host or size their output by it
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.item}
DATA_SHAPED = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSync(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Fails on any op that would make the host wait for the device (module docstring)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in INDEXING:  # data-shaped only with a boolean mask (tagged as always)
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise HostSync(f"{func} with a boolean mask")
        elif packet in SYNCING or any(tag in func.tags for tag in DATA_SHAPED):
            raise HostSync(f"{func} reads tensor data on the host")
        to_copy = packet is aten._to_copy and "device" in kwargs
        if to_copy and torch.device(kwargs["device"]) != args[0].device:
            raise HostSync(f"{func} from {args[0].device} to {kwargs['device']}")
        if packet is aten.copy_ and args[0].device != args[1].device:
            raise HostSync(f"{func} from {args[1].device} to {args[0].device}")
        return func(*args, **kwargs)


def test_the_mode_catches_each_kind_of_sync() -> None:
    x = torch.arange(6.0)
    cases = [
        lambda: x.sum().item(),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),  # data-sized output
        lambda: x.to("meta"),
        lambda: torch.empty(6, device="meta").copy_(x),
    ]
    for case in cases:
        with pytest.raises(HostSync), NoHostSync():
            case()
    with NoHostSync():  # and lets the rest through
        (x[torch.tensor([1, 2])] * 2).argmax(dim=-1)


def decoding_batch(backend: TorchBackend, num_seqs: int) -> Batch:
    """`num_seqs` sequences of different lengths, prefilled (eagerly), each one token behind."""
    rng = random.Random(num_seqs)
    blocks = BlockManager(backend.kv_cache.num_blocks, BLOCK_SIZE)
    seqs = []
    for i in range(num_seqs):
        prompt = [rng.randrange(300) for _ in range(rng.randrange(1, 40))]
        seq = Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=4))
        blocks.allocate(seq, seq.num_tokens)
        seqs.append(seq)
    prefill = Batch(0)
    for seq in seqs:
        prefill.add(seq, seq.num_tokens)
    backend.execute(prefill)
    decode = Batch(1)
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(rng.randrange(300))
        blocks.append(seq)
        decode.add(seq, 1)
    return decode


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_decode_forward_never_syncs(arch: str) -> None:
    backend = TorchBackend(
        tiny_model(arch), tiny_tokenizer(), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=128, max_num_seqs=8, attention_backend="sdpa", cpu_kernels=False,
    )  # fmt: skip
    batch = decoding_batch(backend, 5)
    for pad_to in (None, 8):  # as eager, and as a CUDA graph's padded bucket
        staged = backend.stager.stage(batch, pad_to=pad_to, full_width=pad_to is not None)
        with NoHostSync():
            logits = backend._forward(staged.model_input)
            logits[:, : backend.sampler.vocab_size].argmax(dim=-1)
        assert logits.shape[0] == (pad_to or 5)
