"""The Scheduler plug-in contract (policies and their registry: schedulers/registry.py)."""

from __future__ import annotations

import abc
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from schedulers import defaults
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager, PrefixHit
from schedulers.sequence import (
    QUEUE_TIMEOUT,
    FinishReason,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.drafter import Drafter


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs shared by every policy (a policy's own knobs are its `Options`).

    `max_model_len` is the context window (None: the backend's); the engine caps it at what
    its backend serves and hands the policy a config where it is always set.
    `max_queue_wait_s`: a sequence never scheduled this long after it arrived is finished
    with an error (`error_code` `queue_timeout`) instead of waiting on; None: no limit.
    `enable_prefix_caching`: the engine's block manager keeps the KV of full blocks for
    later sequences starting with the same tokens (admission starts them after the hit).
    `grammar_compile_timeout_s`: the engine's grammar compiler gives up on (and kills) a
    compile running longer (`GrammarLimits.compile_timeout_s`).
    `speculative_config`: prompt-lookup drafts verified in each step (schedulers/spec_decode/,
    `--speculative-config`); None: no speculation, every step as without it.
    """

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    enable_chunked_prefill: bool = False
    max_queue_wait_s: float | None = None
    enable_prefix_caching: bool = False
    grammar_compile_timeout_s: float = defaults.GRAMMAR_COMPILE_TIMEOUT_S
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_queue_wait_s is not None and self.max_queue_wait_s <= 0:
            raise ValueError("max_queue_wait_s must be positive")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive")


class AdmissionError(ValueError):
    """A request that can never run here (too long for the context or the whole KV cache)."""

    def __init__(self, message: str, code: str = "context_length_exceeded") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class NoOptions:
    """The options of a policy that has none of its own."""


class Scheduler(abc.ABC):
    """Decides, once per iteration, which sequences run and how many tokens each computes.

    Policies share the sequence state and the block manager; they differ only in whom they
    admit and when. Not thread-safe: the engine calls it from its loop thread only.

    A policy's own knobs are a frozen dataclass named in `Options`: each field's default,
    type and `metadata["help"]` become a flag, a `CAROUSEL_*` variable, a YAML key and a
    per-arm override (gateway/settings/load.py); `__post_init__` raises ValueError on bad values.
    """

    #: the name it is registered under (set by `register_scheduler`)
    name: ClassVar[str] = ""
    #: the dataclass of this policy's own options
    Options: ClassVar[type[Any]] = NoOptions

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, options: Any = None
    ) -> None:
        self.config = config
        self.options = self.Options() if options is None else options
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._iteration = 0
        #: what "now" is to the policy (arrival times are in its frame); a simulator in
        #: virtual time replaces it (backends/sim_plan.py)
        self.clock: Callable[[], float] = time.monotonic
        #: drafts for every policy's decoding rows (None: speculation off, nothing asked)
        spec = config.speculative_config
        self.drafter: Drafter | None = None if spec is None else Drafter(spec)

    # -- requests in and out -------------------------------------------------------------------

    def check_admissible(self, seq: Sequence) -> None:
        """Raise AdmissionError when `seq` could never run, even alone."""
        total = seq.max_total_tokens
        if total > self.max_model_len:
            raise AdmissionError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({seq.num_prompt_tokens} in the "
                f"prompt, {seq.sampling_params.max_tokens} for the completion). Please reduce "
                "the prompt or max_tokens."
            )
        bm = self.block_manager
        if bm.max_blocks(total) > bm.num_blocks:
            raise AdmissionError(
                f"The request needs {total} tokens of KV cache but the whole cache holds "
                f"{bm.num_blocks * bm.block_size // (1 + len(bm.windows))}. Please reduce "
                "the prompt or max_tokens."
            )

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (raises AdmissionError when it can never fit)."""
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove a waiting or running sequence, freeing its blocks; None if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self.finish(seq, FinishReason.ABORT)
                    return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Mark `seq` finished and free its KV blocks (the caller removed it from queues)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = self.clock()
        self.block_manager.free(seq)
        if self.drafter is not None:
            self.drafter.release(seq.seq_id)

    def expire_waiting(self, now: float) -> list[Sequence]:
        """Finish (with `queue_timeout`) waiting sequences never scheduled within
        `max_queue_wait_s`; return them. Preempted sequences already ran and stay queued."""
        limit = self.config.max_queue_wait_s
        if limit is None:
            return []
        expired = [
            seq
            for seq in self.waiting
            if seq.first_scheduled_time is None and now - seq.arrival_time > limit
        ]
        if not expired:
            return []
        gone = set(expired)
        self.waiting = deque(seq for seq in self.waiting if seq not in gone)
        for seq in expired:
            self.finish(
                seq,
                FinishReason.ERROR,
                f"the request waited {now - seq.arrival_time:.1f} s without being scheduled "
                f"(the limit is {limit:g} s)",
            )
            seq.error_code = QUEUE_TIMEOUT
        return expired

    # -- admission (shared by every policy) ------------------------------------------------

    def prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix `seq` (waiting, holding no blocks) can start from now.

        NO_HIT with prefix caching off. Valid until the block manager next changes: look it
        up just before `admit`.
        """
        return self.block_manager.computed_prefix(seq)

    def waits_for_leader(self, seq: Sequence) -> bool:
        """Whether a later choice of an `n > 1` request should not start yet.

        With prefix caching on, choice i > 0 waits until choice 0 (its leader) has computed
        the prompt blocks they would share, then starts from them: the prompt is prefilled
        once. It does not wait when its leader has finished or there is no full block to share.
        """
        leader = seq.leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        block_size = self.block_manager.block_size
        shareable = (seq.num_prompt_tokens - 1) // block_size * block_size
        return leader.num_computed_tokens < shareable

    def waits_for_grammar(self, seq: Sequence) -> bool:
        """Whether `seq`'s output grammar is still compiling: it is not scheduled until the
        grammar is ready (the engine never waits on a compile; a failed compile is
        finished by `fail_grammar_errors`)."""
        grammar = seq.grammar
        return grammar is not None and not grammar.is_ready() and grammar.error is None

    def must_wait(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may not start this step: its grammar is compiling
        (`waits_for_grammar`) or its leader has not computed the shared prompt yet
        (`waits_for_leader`). Every policy passes such sequences over."""
        return self.waits_for_grammar(seq) or self.waits_for_leader(seq)

    def fail_grammar_errors(self) -> list[Sequence]:
        """Finish (with the compiler's error) the waiting sequences whose grammar failed to
        compile; return them."""
        failed = [
            seq for seq in self.waiting if seq.grammar is not None and seq.grammar.error is not None
        ]
        for seq in failed:
            assert seq.grammar is not None and seq.grammar.error is not None
            self.waiting.remove(seq)
            self.finish(seq, FinishReason.ERROR, seq.grammar.error.message)
            seq.error_code = seq.grammar.error.code.value
        return failed

    def admit(self, seq: Sequence, hit: PrefixHit, num_tokens: int, batch: Batch) -> None:
        """Start `seq` from its cached prefix: THE admission step of every policy.

        Takes a reference on each block of `hit` (from `prefix_hit`, looked up since the
        block manager last changed), sets `num_computed_tokens` to the end of the hit and
        allocates blocks for the `num_tokens` tokens after it. Moves `seq` to `running` when
        it is still waiting. The caller has checked that the blocks fit.
        """
        self.block_manager.allocate(seq, hit.num_tokens + num_tokens, hit)
        batch.num_cached_tokens += hit.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit.num_tokens
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def admit_for_step(self, seq: Sequence, budget: int, batch: Batch) -> int:
        """Iteration-level admission (orca, lpm): start `seq` from its longest cached prefix
        and schedule the rest of its tokens (a chunk of them under the token budget when
        chunked prefill is on, or when the batch is still empty). Returns the tokens scheduled,
        0 when `seq` does not fit this step, or its grammar is still compiling (then nothing
        changed).

        A preempted sequence comes back this way too: its full blocks stayed cached, so it
        recomputes only what was evicted meanwhile.
        """
        if self.waits_for_grammar(seq):
            return 0
        hit = self.prefix_hit(seq)
        num_tokens = seq.num_tokens - hit.num_tokens
        if num_tokens > budget:
            if not (self.config.enable_chunked_prefill or batch.is_empty):
                return 0
            num_tokens = budget
        if not self.block_manager.can_allocate(seq, hit.num_tokens + num_tokens, hit):
            return 0
        self.admit(seq, hit, num_tokens, batch)
        batch.add(seq, num_tokens)
        return num_tokens

    # -- the iteration -----------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Decide the next iteration."""
        self._iteration += 1
        batch = Batch(iteration=self._iteration)
        self._schedule(batch)
        if self.drafter is not None:
            budget = self.config.max_num_batched_tokens
            self.drafter.add_drafts(batch, self.block_manager, budget, self.max_model_len)
        now = self.clock()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return batch

    @abc.abstractmethod
    def _schedule(self, batch: Batch) -> None:
        """Fill `batch`, allocating KV blocks for every scheduled token."""

    def update(self, batch: Batch, output: ExecuteOutput) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish and free; return finished.

        A row that verified drafts: its rejected drafts are not computed (`num_computed_tokens`
        counts its own token, then one more per emitted token after the first: each is an
        accepted draft whose KV the step wrote), its emitted tokens are appended one at a
        time, each checked as a sampled token is, and those after the one that finished it
        are dropped (`output.verified` cut to match). Blocks are registered after the append
        (only computed slots are hashed, so only real tokens' blocks ever are)."""
        finished: list[Sequence] = []
        now = self.clock()
        drafted = batch.draft_token_ids
        for i, (seq, num_tokens) in enumerate(
            zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
        ):
            if seq.is_finished:  # aborted while the step ran
                continue
            drafts = drafted.get(i, ()) if drafted else ()
            seq.num_computed_tokens += num_tokens - len(drafts)
            tokens = output.verified.get(seq.seq_id) if drafts else None
            if tokens is not None:
                assert self.drafter is not None
                self.drafter.observe(seq.seq_id, len(drafts), len(tokens) - 1)
            else:
                sampled = output.sampled.get(seq.seq_id)
                tokens = [] if sampled is None else [sampled]
            kept, reason, error = self._append_emitted(seq, tokens, now)
            if len(kept) < len(tokens):
                output.verified[seq.seq_id] = kept
            self.block_manager.cache_full_blocks(seq)
            if reason is not None:
                self.running.remove(seq)
                self.finish(seq, reason, error)
                finished.append(seq)
        return finished

    def _append_emitted(
        self, seq: Sequence, tokens: list[TokenLogprob], now: float
    ) -> tuple[list[TokenLogprob], FinishReason | None, str | None]:
        """Append `tokens` to `seq` until one finishes it: (those appended, why it finished,
        the grammar's error)."""
        for n, sampled in enumerate(tokens):
            if n:  # the draft this token follows was accepted: its KV is a real token's now
                seq.num_computed_tokens += 1
            seq.output_token_ids.append(sampled.token_id)
            seq.output_logprobs.append(sampled)
            if seq.first_token_time is None:
                seq.first_token_time = now
            error = self._advance_grammar(seq, sampled.token_id)
            reason = FinishReason.ERROR if error is not None else self.stop_reason(seq)
            if reason is not None:
                return tokens[: n + 1], reason, error
        return tokens, None, None

    @staticmethod
    def _advance_grammar(seq: Sequence, token_id: int) -> str | None:
        """Advance `seq`'s grammar by its sampled token; the error when the grammar forbids
        it (the sampler's mask makes that impossible unless a backend ignored the mask)."""
        if seq.grammar is None or seq.grammar.accept(token_id):
            return None
        return f"the sampled token {token_id} is not allowed by the request's output grammar"

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Token-level stop checks: the grammar terminated (after its last token, a stop
        token was accepted; whatever `ignore_eos` says), EOS, stop token ids, max_tokens,
        context window."""
        if seq.grammar is not None and seq.grammar.is_terminated:
            return FinishReason.STOP
        params = seq.sampling_params
        last = seq.output_token_ids[-1]
        if not params.ignore_eos and last in seq.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish_running(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Finish a sequence found in a queue (stop string, step failure)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.is_finished:
            self.finish(seq, reason, error)

    # -- introspection -----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """The context window (unbounded when the config leaves it to the backend)."""
        return self.config.max_model_len or sys.maxsize

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_wakeup(self) -> float | None:
        """Monotonic time at which an idle scheduler wants to be asked again (static's wait)."""
        return None
