"""Decode throughput at batch size B: HF's own forward with its KV cache vs our backend.

Usage: python scripts/bench_forward.py [--batch-sizes 1,8,32,64] [--steps 32] [--prompt-len 64]
                                       [--dtype bfloat16] [--compare-prepack]

Both sides run the same model weights, greedy, on the same device and dtype, one after the
other in this process, so the ratio is meaningful on a noisy machine. "engine-bare" is our
backend's `execute` (flat selective-batching forward over the paged KV cache plus sampling)
in a loop with no scheduler and no HTTP. `--compare-prepack` adds the same engine over the
same weights with `prepack_weights=False` (plain `F.linear`), interleaved, to show what the
oneDNN-prepacked matmuls (backends/torch/layers/linear.py) buy.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from transformers import DynamicCache

from backends.torch.runner.backend import TorchBackend
from backends.torch.runner.device_thread import run_on_device_thread
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob


def hf_decode_tok_s(model: torch.nn.Module, batch: int, prompt_len: int, steps: int) -> float:
    """Output tokens/s of HF's forward with a DynamicCache, B sequences decoding together."""
    ids = torch.randint(100, 1000, (batch, prompt_len), device=model.device)
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


class DecodeBatch:
    """B sequences with random `prompt_len`-token prompts on `backend`: prefill, then decode.

    Drives the backend's `execute` directly (no scheduler, no HTTP), allocating KV blocks
    with a `BlockManager` the way the scheduler would; `close()` frees them again.
    """

    def __init__(self, backend: TorchBackend, batch: int, prompt_len: int, max_steps: int) -> None:
        self.backend = backend
        spec = backend.kv_cache_spec
        self.block_manager = BlockManager(spec.num_blocks, spec.block_size, windows=spec.windows)
        params = SamplingParams(max_tokens=max_steps + 1, temperature=0.0, ignore_eos=True)
        self.seqs = [
            Sequence(i, f"b{i}", torch.randint(100, 1000, (prompt_len,)).tolist(), params)
            for i in range(batch)
        ]
        self._run([prompt_len] * batch)

    def step(self) -> None:
        """One decode step: every sequence's newest token in, one sampled token out."""
        self._run([1] * len(self.seqs))

    def _run(self, num_tokens: list[int]) -> None:
        b = Batch(iteration=0)
        for seq, n in zip(self.seqs, num_tokens, strict=True):
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            b.add(seq, n)
        out = self.backend.execute(b)
        for seq, n in zip(self.seqs, num_tokens, strict=True):
            seq.num_computed_tokens += n
            tok: TokenLogprob = out.sampled[seq.seq_id]
            seq.output_token_ids.append(tok.token_id)

    def close(self) -> None:
        for seq in self.seqs:
            self.block_manager.free(seq)
            self.backend.release(seq.seq_id)


def decode_step_times(
    backend: TorchBackend, batch: int, prompt_len: int, steps: int
) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences (after the prefill)."""
    run = DecodeBatch(backend, batch, prompt_len, steps)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run.step()
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    run.close()
    return times


def decode_step_s(backend: TorchBackend, batch: int, prompt_len: int, steps: int) -> float:
    """Mean seconds of one decode step of `batch` sequences (after a `prompt_len` prefill)."""
    return sum(decode_step_times(backend, batch, prompt_len, steps)) / steps


def engine_decode_tok_s(backend: TorchBackend, batch: int, prompt_len: int, steps: int) -> float:
    """Output tokens/s of our backend's execute() in a bare loop (no scheduler, no HTTP)."""
    return batch / decode_step_s(backend, batch, prompt_len, steps)


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON line per B")
    parser.add_argument("--compare-prepack", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats (best)")
    args = parser.parse_args()
    backend = TorchBackend.load(
        args.model, device=args.device, dtype=args.dtype, kv_cache_gb=1.0, max_model_len=1024
    )
    model = backend.hf_model
    plain = None
    if args.compare_prepack:
        plain = TorchBackend.create(
            model, backend.tokenizer, device=args.device, dtype=args.dtype, kv_cache_gb=1.0,
            max_model_len=1024, prepack_weights=False,
        )  # fmt: skip
    print(f"device={backend.device} dtype={backend.dtype} torch_threads={torch.get_num_threads()}")
    extra = f" {'plain tok/s':>12} {'engine/plain':>13}" if plain else ""
    print(f"{'B':>4} {'hf tok/s':>10} {'engine tok/s':>13} {'engine/hf':>10}{extra}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        engine_decode_tok_s(backend, b, args.prompt_len, 4)  # warm-up
        if plain is not None:
            engine_decode_tok_s(plain, b, args.prompt_len, 4)
        runs: dict[str, list[float]] = {"hf": [], "engine": [], "plain": []}
        for _ in range(args.repeats):  # interleaved: drift hits every column alike
            # NOTE: HF's forward on the device thread too: a second OpenMP pool on this thread
            # would slow every later step (TorchBackend.create)
            runs["hf"].append(
                run_on_device_thread(hf_decode_tok_s, model, b, args.prompt_len, args.steps)
            )
            runs["engine"].append(engine_decode_tok_s(backend, b, args.prompt_len, args.steps))
            if plain is not None:
                runs["plain"].append(engine_decode_tok_s(plain, b, args.prompt_len, args.steps))
        hf, ours = max(runs["hf"]), max(runs["engine"])
        record = {"batch": b, "hf_tok_s": hf, "engine_tok_s": ours}
        line = f"{b:>4} {hf:>10.1f} {ours:>13.1f} {ours / hf:>10.2f}"
        if plain is not None:
            record["plain_tok_s"] = best = max(runs["plain"])
            line += f" {best:>12.1f} {ours / best:>13.2f}"
        if args.json:
            print(json.dumps(record))
        print(line, flush=True)


if __name__ == "__main__":
    main()
