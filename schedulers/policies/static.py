"""`static`: request-level batching, the Orca paper's baseline (FasterTransformer style)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schedulers.base import Scheduler, SchedulerConfig
from schedulers.batch import Batch
from schedulers.block_manager import NO_HIT, BlockManager
from schedulers.registry import register_scheduler
from schedulers.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class StaticOptions:
    """static's own knobs."""

    batch_wait_ms: float = field(
        default=0.0, metadata={"help": "static: wait this long (ms) for a batch to fill"}
    )
    max_batch_size: int = field(
        default=0, metadata={"help": "static: most requests in a batch (0: max_num_seqs)"}
    )
    num_microbatches: int = field(
        default=1,
        metadata={"help": "static: microbatches a batch is cut into (a pipelined backend's)"},
    )
    align_prompts: bool = field(
        default=False,
        metadata={
            "help": "static: a batch's first step prefills each member only up to the "
            "shortest prompt in it, the rest of longer prompts one token per step "
            "(FasterTransformer's batches)"
        },
    )

    def __post_init__(self) -> None:
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be at least 0, got {self.batch_wait_ms}")
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be at least 0, got {self.max_batch_size}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {self.num_microbatches}")


@register_scheduler("static")
class StaticScheduler(Scheduler):
    """Form a batch when nothing runs; run it until every member has finished.

    A batch takes up to `max_batch_size` (default `max_num_seqs`) waiting requests in arrival
    order, waiting up to `batch_wait_ms` after the oldest arrived for it to fill. Formation
    reserves each member's worst case (prompt + max_tokens) in KV blocks, as the baseline
    systems do, so a running batch never runs out (a sliding-window group's share: only the
    blocks its window and one step span, `num_reserved_blocks`); with prefix caching on, a
    member starts from its cached prefix at formation and its reservation leaves out the
    blocks it shares. A request whose output grammar is still compiling is passed over (it
    joins a later batch). The members' prompts are prefilled together, spread over as many
    iterations as the token budget needs. Nobody joins meanwhile; a member that finishes early
    returns at once and its seat stays empty until the whole batch is done. The later choices
    of an `n > 1` request start once their first choice has cached the prompt (see
    `Scheduler.waits_for_leader`). `num_microbatches` is for a pipelined backend
    (backends/sim_plan.py reads it). `align_prompts` runs a batch as FasterTransformer does
    (Yu et al., OSDI '22, section 6.2): its first step takes every member as if its prompt
    were the batch's shortest, and a longer member feeds the rest of its prompt one token per
    step before its first output token.
    """

    Options = StaticOptions
    options: StaticOptions

    @property
    def batch_size_limit(self) -> int:
        """The most members of one batch."""
        limit = self.options.max_batch_size or self.config.max_num_seqs
        return min(limit, self.config.max_num_seqs)

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, options: Any = None
    ) -> None:
        super().__init__(config, block_manager, options)
        #: members reserved at formation that start once their leader has cached the prompt
        self._followers: list[Sequence] = []
        #: with `align_prompts`: the shortest prompt of the running batch
        self._aligned_len = 0

    def _schedule(self, batch: Batch) -> None:
        if not self.running:
            if not self._ready_to_form():
                return
            self._form_batch(batch)
        self._start_followers(batch)
        budget = self.config.max_num_batched_tokens
        for seq in self.running:
            if budget <= 0:
                break
            if seq in self._followers:
                continue
            num_tokens = min(self._step_tokens(seq), budget)
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_tokens)
            batch.add(seq, num_tokens)
            budget -= num_tokens

    def _step_tokens(self, seq: Sequence) -> int:
        """What `seq` runs this step: the rest of its prompt, or with `align_prompts` up to
        the batch's shortest prompt and then one token per step."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if not self.options.align_prompts:
            return remaining
        return min(remaining, max(1, self._aligned_len - seq.num_computed_tokens))

    def _ready_to_form(self) -> bool:
        if not self.waiting:
            return False
        if len(self.waiting) >= self.batch_size_limit:
            return True
        return self.clock() >= self._form_deadline()

    def _form_deadline(self) -> float:
        """When the oldest waiting request stops waiting for the batch to fill."""
        return self.waiting[0].arrival_time + self.options.batch_wait_ms / 1000.0

    def _form_batch(self, batch: Batch) -> None:
        """Take waiting requests while their worst cases fit, each starting from its cached
        prefix at once (so no other member's allocation can evict what its reservation
        counts on). A reservation counts only the blocks a member does not share."""
        bm = self.block_manager
        free_blocks = bm.num_free_blocks
        for seq in list(self.waiting):
            if len(self.running) >= self.batch_size_limit:
                break
            if self.waits_for_grammar(seq):  # it joins a later batch, once compiled
                continue
            follows = self.waits_for_leader(seq)
            hit = NO_HIT if follows else self.prefix_hit(seq)
            reserve = bm.num_reserved_blocks(seq, seq.max_total_tokens, self._most_step(seq), hit)
            if self.running and reserve > free_blocks:
                break
            if follows:  # NOTE: reserved in full; it starts from its leader's blocks later
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._followers.append(seq)
            else:
                self.admit(seq, hit, 0, batch)
            free_blocks -= reserve
        self._aligned_len = min((len(s.prompt_token_ids) for s in self.running), default=0)

    def _most_step(self, seq: Sequence) -> int:
        """The most tokens one step of `seq` computes: its prompt within the token budget, or
        a decode with its drafts (a sliding window's blocks are reserved for that much)."""
        spec = self.config.speculative_config
        decode = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        return max(min(seq.num_tokens, self.config.max_num_batched_tokens), decode)

    def _start_followers(self, batch: Batch) -> None:
        """Start the later choices whose leader has now cached the prompt, from its blocks
        (before any other allocation of this step, so none of them is evicted first)."""
        for seq in list(self._followers):
            if seq.is_finished:
                self._followers.remove(seq)
            elif not self.waits_for_leader(seq):
                self._followers.remove(seq)
                self.admit(seq, self.prefix_hit(seq), 0, batch)

    def next_wakeup(self) -> float | None:
        if self.running or not self.waiting:
            return None
        return self._form_deadline()
