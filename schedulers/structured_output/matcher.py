"""One sequence's position in its grammar: accept sampled tokens, fill the next-token bitmask.

The engine keeps one `SequenceGrammar` per constrained sequence (n > 1: one per choice, all
sharing one compiled grammar). It is created from the compile future at once; until that
resolves, `is_ready()` is False and the scheduler leaves the sequence waiting, so the engine
never waits on a compile. A sequence whose grammar failed (`error`) is finished with that
error.

NOTE: the matcher must always stand at the end of `output_token_ids`. Preemption by
recompute keeps the output, so the state stays valid as is; `sync(output_token_ids)`
restores the invariant whenever the output could have changed under it: a no-op when it
matches, else a rollback to the longest common prefix (xgrammar keeps the whole history, so
rolling back k tokens costs O(k)) and a replay of the tokens after it. Rolling back is
chosen over rebuilding: it is exact and never costs more than replaying from the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from schedulers.structured_output.compiler import CompiledGrammar
from schedulers.structured_output.spec import GrammarError


class SequenceGrammar:
    """The matcher state of one sequence (xgrammar's GrammarMatcher, created when ready)."""

    def __init__(self, grammar: CompiledGrammar | Future[CompiledGrammar | GrammarError]) -> None:
        self._future: Future[CompiledGrammar | GrammarError] | None = None
        self._compiled: CompiledGrammar | None = None
        self._error: GrammarError | None = None
        self._matcher: Any = None
        self.token_ids: list[int] = []  # accepted so far, in order
        if isinstance(grammar, CompiledGrammar):
            self._start(grammar)
        else:
            self._future = grammar

    def is_ready(self) -> bool:
        """Whether the grammar has compiled (False while compiling and after a failure)."""
        if self._matcher is None and self._error is None and self._future is not None:
            if not self._future.done():
                return False
            result = self._future.result()
            if isinstance(result, GrammarError):
                self._error = result
            else:
                self._start(result)
        return self._matcher is not None

    @property
    def error(self) -> GrammarError | None:
        """Why the grammar could not be compiled (None while compiling or once ready)."""
        self.is_ready()
        return self._error

    @property
    def compiled(self) -> CompiledGrammar | None:
        return self._compiled

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted after a complete output: the sequence must finish."""
        return bool(self._ready_matcher().is_terminated())

    @property
    def is_completed(self) -> bool:
        """The tokens so far form a complete output (only stop tokens may follow)."""
        return bool(self._ready_matcher().is_completed())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it."""
        accepted = bool(self._ready_matcher().accept_token(token_id))
        if accepted:
            self.token_ids.append(token_id)
        return accepted

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 [R, W] on the
        CPU, W = ceil(vocab_size / 32), bit j of word i set = token 32 * i + j allowed).

        Raises RuntimeError once terminated: a terminated sequence must finish, not sample.
        """
        matcher = self._ready_matcher()
        if matcher.is_terminated():
            raise RuntimeError("the grammar has terminated: the sequence must finish")
        matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self.token_ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.token_ids)} tokens")
        if num_tokens:
            self._ready_matcher().rollback(num_tokens)
            del self.token_ids[-num_tokens:]

    def sync(self, output_token_ids: Sequence[int]) -> bool:
        """Bring the state to the end of `output_token_ids` (see the module NOTE).

        Returns False when the grammar rejects those tokens (the state then stands at the
        longest accepted prefix).
        """
        common = 0
        limit = min(len(self.token_ids), len(output_token_ids))
        while common < limit and self.token_ids[common] == output_token_ids[common]:
            common += 1
        self.rollback(len(self.token_ids) - common)
        return all(self.accept(token_id) for token_id in output_token_ids[common:])

    def _start(self, compiled: CompiledGrammar) -> None:
        import xgrammar as xgr

        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.handle)

    def _ready_matcher(self) -> Any:
        if not self.is_ready():
            raise RuntimeError("the grammar is not compiled yet (check is_ready() first)")
        return self._matcher
