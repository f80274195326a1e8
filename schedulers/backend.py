"""The Backend contract the engine calls: report KV capacity, execute one Batch, sample.

The engine owns this interface (as vLLM's engine core owns its executor's); implementations
live in backends/ and import it, never the reverse (tests/test_layering.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schedulers.batch import Batch, ExecuteOutput


@dataclass(frozen=True)
class KVCacheSpec:
    """Paged KV capacity: `num_blocks` blocks of `block_size` token slots each."""

    num_blocks: int
    block_size: int
    #: K and V bytes of one block over every layer of its group (0: the backend holds no
    #: tensors, the sim)
    bytes_per_block: int = 0
    #: the sliding window (tokens) of each window group of the KV cache (block_manager.py's
    #: KV cache groups); (): one group, every block holding every layer
    windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class FastRows:
    """Steps of at most `rows` rows run faster kernels (weight-only quantised linears), whose
    work takes `speedup` times less time than the full-precision path's; past `rows` a step
    takes the full-precision path. What the drafter weighs before drafting a step past it."""

    rows: int
    speedup: float


class BackendDeadError(RuntimeError):
    """The backend can never run another step (a tensor-parallel rank died or hung).

    Raised from `execute`, it stops the engine for good (the message becomes its
    `dead_reason`), unlike any other error, which fails only that step's requests.
    """


class Backend(abc.ABC):
    """Executes iterations. Never decides batch membership.

    The engine calls it from its loop thread only (an implementation may hop elsewhere:
    the torch backend runs every forward on one process-wide device thread); `execute` is
    called with a Batch whose sequences' block tables already cover every scheduled token.
    """

    #: HF-compatible tokenizer (encode / decode / convert_ids_to_tokens / apply_chat_template)
    tokenizer: Any
    #: served context window in tokens (prompt + completion)
    max_model_len: int
    #: token ids that end generation unless `ignore_eos`
    eos_token_ids: frozenset[int]

    @property
    def grammar_vocab_size(self) -> int | None:
        """The vocabulary an output grammar's token bitmask covers (the sampler's logits
        width); None: this backend cannot constrain its sampling, so it serves no
        structured outputs."""
        return None

    @property
    def generation_config(self) -> dict[str, Any]:
        """The model's own generation config, the values it writes (HF
        `GenerationConfig.to_diff_dict()`): where `--generation-config auto` finds its sampling
        defaults. Empty: no model, or none written (the sim)."""
        return {}

    @property
    def verifies_drafts(self) -> bool:
        """Whether `execute` verifies a batch's draft tokens (`Batch.draft_token_ids`,
        speculative decoding) into `ExecuteOutput.verified`; the engine refuses
        `speculative_config` over a backend that does not."""
        return False

    @property
    def fast_rows(self) -> FastRows | None:
        """Where its steps run faster kernels (None: every step size runs the same ones)."""
        return None

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Resident weight bytes per format (`bfloat16`, `int4`, ...); empty: no weights."""
        return {}

    @property
    def serving_kernels(self) -> str | None:
        """Which ops serve its forward (load_phase.py's `KERNELS_*`: `torch`, `building` while
        Carousel's CPU kernels build in the background, `carousel`); None: not a CPU forward
        (the sim, CUDA)."""
        return None

    @property
    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """Number and size of KV blocks this backend allocated."""

    @abc.abstractmethod
    def execute(self, batch: Batch) -> ExecuteOutput:
        """Run one iteration over `batch` and sample for every sequence that completes."""

    def watch(self, on_dead: Callable[[str], None]) -> None:  # noqa: B027 - optional hook
        """Call `on_dead(reason)` (from any thread) if the backend dies between steps."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """Forget per-sequence state (sampler generators, penalty counts) of a finished seq."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free device memory; the backend is not used afterwards."""
