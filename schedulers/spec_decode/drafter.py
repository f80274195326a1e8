"""The scheduler's side of speculative decoding in one object: drafts into a step, and what
verification says back.

Every policy calls it the same way (schedulers/base.py): once its own `_schedule` has filled
the batch, `add_drafts` gives each decoding row its draft tokens (as vLLM's scheduler does,
at schedule time, so the token budget sees them); after the step, `observe` feeds each
verified row's acceptance to the draft policy and the counters; `release` forgets a finished
sequence. Drafts take only what the policy left: the token budget after every row's own
tokens (prefill chunks included) and free KV blocks (a row that cannot get blocks for its
drafts verifies fewer or none; nothing is preempted for a draft). Where the backend's steps
of few rows run faster kernels (`Backend.fast_rows`: int4 linears up to `R` rows), a step that
fits them drafts only what keeps it there, when that emits more tokens per second. A row
drafts only when it decodes, has no output grammar and no penalties (whose counts would move
within the step).
"""

from __future__ import annotations

from schedulers.backend import FastRows
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sequence import Sequence
from schedulers.spec_decode.budget import allot_drafts, draft_room, fit_fast_rows
from schedulers.spec_decode.config import SpeculativeConfig
from schedulers.spec_decode.ngram import NgramProposer
from schedulers.spec_decode.policy import DraftPolicy, draft_policy
from schedulers.spec_decode.stats import SpecDecodingStats


class Drafter:
    """Drafts for one scheduler's steps (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.policy: DraftPolicy = draft_policy(config)
        self.proposer = NgramProposer.from_config(config)
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        #: the backend's fast step size (the engine sets it): a step that fits it keeps to
        #: it when that emits more per second (budget.fit_fast_rows)
        self.fast_rows: FastRows | None = None

    def add_drafts(
        self, batch: Batch, block_manager: BlockManager, token_budget: int, max_model_len: int
    ) -> None:
        """Give `batch`'s decoding rows their drafts under `token_budget` (the step's whole
        budget) and the free KV blocks, allocating the blocks they need."""
        rows = [i for i in range(len(batch.seqs)) if _decodes(batch, i)]
        if not self.policy.begin_step(len(rows)):
            return
        spare = token_budget - batch.total_tokens
        if spare <= 0:
            return
        proposals: list[tuple[int, list[int]]] = []
        for i in rows:
            seq = batch.seqs[i]
            if not may_draft(seq):
                continue
            k = min(self.policy.draft_len(seq.seq_id), draft_room(seq, max_model_len))
            drafts = self.proposer.propose(seq, k)
            if drafts:
                proposals.append((i, drafts))
        granted = allot_drafts([len(drafts) for _, drafts in proposals], spare)
        fast = self.fast_rows
        if fast is not None:
            p = self.stats.draft_acceptance()
            granted = fit_fast_rows(granted, batch.total_tokens, fast.rows, fast.speedup, p)
        for (i, drafts), count in zip(proposals, granted, strict=True):
            seq = batch.seqs[i]
            count = _kv_room(seq, block_manager, count)
            if count:
                block_manager.allocate(seq, seq.num_computed_tokens + 1 + count)
                batch.add_drafts(i, drafts[:count])

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified row: `num_accepted` of its `num_draft_tokens` drafts."""
        self.policy.observe(seq_id, num_draft_tokens, num_accepted)
        self.stats.observe(num_draft_tokens, num_accepted)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self.policy.release(seq_id)
        self.proposer.release(seq_id)


def may_draft(seq: Sequence) -> bool:
    """Whether `seq` may ever verify drafts: no output grammar (its drafts would need the
    grammar advanced through them) and no penalties (they count the tokens before each
    position, which a draft would change within the step)."""
    return seq.grammar is None and not seq.sampling_params.has_penalties


def _decodes(batch: Batch, i: int) -> bool:
    """Whether row `i` computes just its sequence's last sampled token."""
    seq = batch.seqs[i]
    own = seq.num_tokens - seq.num_computed_tokens
    return own == 1 and batch.num_scheduled_tokens[i] == 1 and seq.num_output_tokens > 0


def _kv_room(seq: Sequence, block_manager: BlockManager, want: int) -> int:
    """The most drafts, up to `want`, that `seq`'s blocks and the free ones can hold after
    its own token (every KV cache group's blocks counted)."""
    while want and not block_manager.can_allocate(seq, seq.num_computed_tokens + 1 + want):
        want -= 1
    return want
