"""A weight-free executor: a cost model for time and deterministic tokens.

For fast scheduler and gateway tests, and for capacity planning beyond this machine. The
time of one iteration is `fixed_s + per_token_s * scheduled_tokens + per_context_token_s *
attended context tokens`, plus, under tensor parallelism, the all-reduces of the step
(`CostModel.communication_s`), slept for real scaled by `time_scale` (0 = do not sleep) and
also accumulated in `virtual_time_s`. backends/sim_plan.py derives these terms from a
model's shape and a GPU's datasheet (scripts/plan_tp.py).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from backends.byte_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from schedulers import defaults
from schedulers.backend import Backend, KVCacheSpec
from schedulers.batch import Batch, ExecuteOutput
from schedulers.sequence import Sequence, TokenLogprob

_MASK = (1 << 64) - 1
# NOTE: printable ASCII letters and a space, so simulated text reads as words.
_ALPHABET = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz      "]


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class CostModel:
    """Per-iteration cost: fixed + per scheduled token + per attended context token, plus the
    tensor-parallel all-reduces when `tensor_parallel_size` > 1.

    Megatron-style TP all-reduces the `[tokens, hidden]` activations twice per layer (after
    the attention output and the MLP down projection) and once after the vocabulary-parallel
    embedding. Each is a ring all-reduce over `n` ranks: `2 (n - 1)` hops of
    `link_latency_s`, moving `2 (n - 1) / n` of the message over each link at
    `link_bandwidth` bytes/s (NCCL's "bus bandwidth").
    """

    fixed_s: float = 0.004
    per_token_s: float = 0.0002
    per_context_token_s: float = 0.000002
    tensor_parallel_size: int = 1
    num_layers: int = 0
    hidden_size: int = 0
    activation_bytes: int = 2
    link_latency_s: float = 5e-6
    link_bandwidth: float = 100e9
    #: pipeline stages, each running `num_layers / pipeline_parallel_size` layers in turn
    pipeline_parallel_size: int = 1
    #: pieces a batch is cut into to keep the stages busy (FasterTransformer's microbatches)
    num_microbatches: int = 1
    #: sending one microbatch's activations to the next stage (inter-node in the paper)
    stage_link_latency_s: float = 0.0

    def all_reduce_s(self, num_bytes: float) -> float:
        """One ring all-reduce of `num_bytes` over the TP ranks (0 without TP)."""
        n = self.tensor_parallel_size
        hops = 2 * (n - 1)
        return hops * self.link_latency_s + hops / n * num_bytes / self.link_bandwidth

    def communication_s(self, num_tokens: float) -> float:
        """The step's all-reduces: 2 per layer plus the embedding's."""
        message = num_tokens * self.hidden_size * self.activation_bytes
        return (2 * self.num_layers + 1) * self.all_reduce_s(message)

    def iteration_time(
        self, num_tokens: int, num_context_tokens: int, num_seqs: int | None = None
    ) -> float:
        """One step; with pipeline stages or microbatches see `pipelined_time`."""
        if self.pipeline_parallel_size > 1 or self.num_microbatches > 1:
            return self.pipelined_time(num_tokens, num_context_tokens, num_seqs or 1)
        return self._whole_model_time(num_tokens, num_context_tokens)

    def pipelined_time(self, num_tokens: int, num_context_tokens: int, num_seqs: int) -> float:
        """A batch cut into `m` microbatches flows through `p` stages: each stage runs its
        share of the layers per microbatch (its weights read again each time), and a step
        takes `max(m, p)` stage slots, since a microbatch's next token needs its last one."""
        p = self.pipeline_parallel_size
        m = max(1, min(self.num_microbatches, num_seqs))
        stage = self._whole_model_time(num_tokens / m, num_context_tokens / m) / p
        return max(m, p) * (stage + self.stage_link_latency_s * (p > 1))

    def _whole_model_time(self, num_tokens: float, num_context_tokens: float) -> float:
        compute = (
            self.fixed_s
            + self.per_token_s * num_tokens
            + self.per_context_token_s * num_context_tokens
        )
        if self.tensor_parallel_size == 1:
            return compute
        return compute + self.communication_s(num_tokens)


class SimBackend(Backend):
    """Deterministic tokens from (prompt, position[, seed]); EOS with `eos_probability`."""

    def __init__(
        self,
        *,
        num_blocks: int = 1024,
        block_size: int = defaults.BLOCK_SIZE,
        max_model_len: int = 4096,
        cost: CostModel | None = None,
        time_scale: float = 0.0,
        eos_probability: float = 0.0,
        tokenizer: Any = None,
    ) -> None:
        self._spec = KVCacheSpec(num_blocks=num_blocks, block_size=block_size)
        self.max_model_len = max_model_len
        self.cost = cost or CostModel()
        self.time_scale = time_scale
        self.eos_probability = eos_probability
        self.tokenizer = tokenizer or ByteTokenizer()
        eos = getattr(self.tokenizer, "eos_token_id", EOS_TOKEN_ID)
        self.eos_token_ids = frozenset({eos})
        self.virtual_time_s = 0.0
        self.num_iterations = 0
        self._salts: dict[int, int] = {}
        self.fail_next: Exception | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._spec

    def execute(self, batch: Batch) -> ExecuteOutput:
        if self.fail_next is not None:  # test hook: fault injection
            exc, self.fail_next = self.fail_next, None
            raise exc
        self._check_blocks(batch)
        context = sum(
            s.num_computed_tokens + n
            for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
        )
        elapsed = self.cost.iteration_time(batch.total_tokens, context, len(batch.seqs))
        self.virtual_time_s += elapsed
        self.num_iterations += 1
        if self.time_scale > 0:
            time.sleep(elapsed * self.time_scale)
        out = ExecuteOutput()
        for i, seq in enumerate(batch.seqs):
            if batch.samples_after(i):
                out.sampled[seq.seq_id] = self._sample(seq)
        return out

    def release(self, seq_id: int) -> None:
        self._salts.pop(seq_id, None)

    def _check_blocks(self, batch: Batch) -> None:
        """The scheduler's promise: every scheduled token has a slot."""
        size = self._spec.block_size
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            needed = math.ceil((seq.num_computed_tokens + n) / size)
            if len(seq.block_table) < needed:
                raise RuntimeError(f"seq {seq.seq_id} scheduled beyond its block table")

    def _salt(self, seq: Sequence) -> int:
        salt = self._salts.get(seq.seq_id)
        if salt is None:
            params = seq.sampling_params
            if params.temperature == 0.0:
                salt = 0
            elif params.seed is not None:
                salt = _mix(params.seed + 1)
            else:
                salt = random.getrandbits(63)
            for token_id in seq.prompt_token_ids:
                salt = _mix(salt ^ token_id)
            self._salts[seq.seq_id] = salt
        return salt

    def _sample(self, seq: Sequence) -> TokenLogprob:
        h = _mix(self._salt(seq) ^ seq.num_tokens)
        forced = seq.sampling_params.logit_bias
        if forced and max(forced.values()) >= 100:
            token = max(forced, key=lambda t: forced[t])
        elif (h % 10_000) < self.eos_probability * 10_000:
            token = self.eos_token_ids.__iter__().__next__()
        else:
            token = _ALPHABET[(h >> 16) % len(_ALPHABET)]
        top: list[tuple[int, float]] = []
        k = seq.sampling_params.logprobs or 0
        if k:
            top = [(token, -0.1)] + [(_ALPHABET[(h >> (20 + i)) % 26], -2.5 - i) for i in range(k)]
            top = top[:k]
        return TokenLogprob(token_id=token, logprob=-0.1, top=top)
