"""Teacher forcing through the engine's decode path, and the same through HF's forward.

`engine_logits` prefills the first `prefix` tokens of each text, then decodes the rest one
token per step with the *true* next token fed back (never the engine's own choice), all texts
batched together, so the logits at every position come from the batched decode kernels.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from backends.torch.runner.backend import TorchBackend
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence


def engine_logits(backend: TorchBackend, texts: list[list[int]], prefix: int) -> list[torch.Tensor]:
    """Per text, fp32 logits (len - prefix, V) predicting tokens `prefix..len-1`."""
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
    params = SamplingParams(max_tokens=max(map(len, texts)), ignore_eos=True)
    seqs = [Sequence(i, f"tf{i}", text[:prefix], params) for i, text in enumerate(texts)]
    rows: list[list[torch.Tensor]] = [[] for _ in texts]
    scheduled = [prefix] * len(seqs)
    while True:
        live = [i for i in range(len(seqs)) if len(rows[i]) < len(texts[i]) - prefix]
        if not live:
            break
        batch = Batch(0)
        for i in live:
            blocks.allocate(seqs[i], seqs[i].num_computed_tokens + scheduled[i])
            batch.add(seqs[i], scheduled[i])
        logits = backend.logits(batch)
        for row, i in enumerate(live):
            seq = seqs[i]
            rows[i].append(logits[row])
            seq.num_computed_tokens += scheduled[i]
            seq.output_token_ids.append(texts[i][seq.num_tokens])  # the true next token
            scheduled[i] = 1
    for seq in seqs:
        blocks.free(seq)
    assert blocks.num_free_blocks == blocks.num_blocks
    return [torch.stack(r) for r in rows]


def hf_logits(model: PreTrainedModel, texts: list[list[int]], prefix: int) -> list[torch.Tensor]:
    """The same positions' fp32 logits from HF's own forward over each whole text alone."""
    out = []
    with torch.inference_mode():
        for text in texts:
            logits = model(torch.tensor([text], device=model.device)).logits[0].float()
            out.append(logits[prefix - 1 : len(text) - 1])
    return out


def top1_agreement(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """Share of positions whose argmax token is the same."""
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, theirs, strict=True))
    return same / sum(a.shape[0] for a in ours)


def engine_greedy(backend: TorchBackend, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of `max_new` tokens (EOS ignored), all prompts decoding together."""
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(i, f"g{i}", list(p), params) for i, p in enumerate(prompts)]
    for _ in range(max_new):
        batch = Batch(0)
        for seq in seqs:
            blocks.allocate(seq, seq.num_tokens)
            batch.add(seq, seq.num_tokens - seq.num_computed_tokens)
        sampled = backend.execute(batch).sampled
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
            seq.output_token_ids.append(sampled[seq.seq_id].token_id)
    for seq in seqs:
        blocks.free(seq)
        backend.release(seq.seq_id)
    return [seq.output_token_ids for seq in seqs]
