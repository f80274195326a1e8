"""Per-request sampling parameters, shared by the scheduler, the sampler and the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from concurrent.futures import Future

    from schedulers.structured_output import CompiledGrammar, GrammarError

MAX_LOGPROBS = 20

#: what `SamplingParams.grammar` holds: a compiled grammar, or the compiler's future of one
GrammarHandle: TypeAlias = "CompiledGrammar | Future[CompiledGrammar | GrammarError]"


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token and when it stops.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1.0` disable those filters.
    `logprobs` is None for no logprobs, else the number of top alternatives (0..20) returned
    beside the sampled token's own logprob. `seed` makes a request's samples reproducible
    whatever its batch mates are.

    `grammar` constrains the output (structured outputs, tool calls;
    docs/structured-outputs.md): a `CompiledGrammar` from the arm's `GrammarCompiler`, or
    that compiler's future of one. The engine gives each sequence its own matcher over it
    (n > 1: one per choice); a sequence whose grammar is still compiling is not scheduled
    yet, and one whose compile failed finishes with that error. The gateway awaits the
    compile itself (so a bad grammar is a 400 before anything is queued) and hands over
    the compiled grammar.

    Scheduling hints, read by the policies that order by them; sampling ignores them:
    `principal` is whom the request is served for (`fair` shares service by it): the gateway
    gives the name its API key resolves to, or the request's `user` on a gateway without keys.
    `deadline_ms` is the first token's deadline, ms after arrival (`X-Carousel-Deadline-Ms`;
    `edf`), and `min_deadline_ms` the earliest the principal may have (its key file's cap:
    `edf` lifts a default deadline to it).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    grammar: GrammarHandle | None = field(default=None, compare=False, repr=False)
    principal: str | None = None
    deadline_ms: float | None = None
    min_deadline_ms: float | None = None

    def __post_init__(self) -> None:
        problems = list(self.problems())
        if problems:
            raise ValueError(problems[0][1])

    def problems(self) -> list[tuple[str, str]]:
        """(param, message) for every invalid value; empty when all are valid."""
        out: list[tuple[str, str]] = []
        if self.max_tokens < 1:
            out.append(("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"))
        if not 0.0 <= self.temperature <= 2.0:
            out.append(("temperature", f"temperature must be in [0, 2], got {self.temperature}"))
        if not 0.0 < self.top_p <= 1.0:
            out.append(("top_p", f"top_p must be in (0, 1], got {self.top_p}"))
        if self.top_k < 0:
            out.append(("top_k", f"top_k must be 0 (disabled) or positive, got {self.top_k}"))
        if not 0.0 <= self.min_p <= 1.0:
            out.append(("min_p", f"min_p must be in [0, 1], got {self.min_p}"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                out.append((name, f"{name} must be in [-2, 2], got {value}"))
        if self.repetition_penalty <= 0.0:
            out.append(("repetition_penalty", "repetition_penalty must be positive"))
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                out.append(("logit_bias", f"logit_bias for {token_id} must be in [-100, 100]"))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            out.append(("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}]"))
        if self.n < 1:
            out.append(("n", f"n must be at least 1, got {self.n}"))
        for name in ("deadline_ms", "min_deadline_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                out.append((name, f"{name} must be positive, got {value}"))
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
