"""Workloads: length distributions, arrival schedules, synthetic prompts and JSONL datasets.

A workload is fixed before the first request is sent, from `--seed`, so every arm (and every
rate of a sweep) replays exactly the same prompts, output lengths and arrival pattern.

Length distributions (`DIST` strings):

- `fixed:N`, or just `N`: always N tokens.
- `uniform:LO:HI`: an integer drawn uniformly from [LO, HI], both ends included.
- `lognormal:MEDIAN:SIGMA[:CAP]`: `round(MEDIAN * exp(SIGMA * Z))`, Z standard normal,
  clipped to [1, CAP] (no cap when CAP is left out).
- presets, which mean something different for inputs and outputs:
  `orca` (input `uniform:32:512`, output `uniform:1:128`, the Orca paper's synthetic trace)
  and `heavy-tail` (input `uniform:32:512`, output `lognormal:48:1.0:256`).

Arrivals: the gaps between requests are Gamma(shape=K, scale=1/(R*K)) for rate R req/s and
burstiness K, vLLM's knob: mean gap 1/R whatever K, coefficient of variation 1/sqrt(K), so
K = 1 is a Poisson process, K < 1 burstier, K > 1 more regular. Rate `inf` sends everything
at once. The first request always goes at t = 0.

Synthetic prompts are random sequences of short, common English words, one word per
requested input token: BPE tokenizers (Llama, GPT, SmolLM, Qwen) encode each of these words
with its leading space as a single token, so the prompt lands within a few percent of the
target, plus the chat template's own tokens. The bench records the `prompt_tokens` the server
reports, so the report shows the real sizes. Each prompt is drawn independently, so prompts
share no long prefix (a prefix cache cannot make them cheaper).

Two workloads share prefixes on purpose, for prefix caching:

- `--shared-prefix-len N` (`add_shared_prefix`): every conversation starts with the same
  N-word system prompt (as vLLM's `prefix_repetition` dataset does), then its own question.
- `--multi-turn K` (`build_conversations`): `--num-requests` conversations of K turns; each
  turn's question is drawn like a prompt above, and the client sends turn t + 1 after turn t's
  answer arrived, with the whole history (questions and the answers as received).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

Kind = Literal["input", "output"]

PRESETS: dict[str, dict[Kind, str]] = {
    "orca": {"input": "uniform:32:512", "output": "uniform:1:128"},
    "heavy-tail": {"input": "uniform:32:512", "output": "lognormal:48:1.0:256"},
}

# Short, frequent words: each is one token (with its leading space) in common BPE vocabularies.
_WORD_TEXT = (
    "the of and to in is it you that he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part over new sound take only little work know place year live me back give most very "
    "after thing our just name good man think say great where help through much before line "
    "right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went "
    "men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, parsed from a DIST string (see the module docstring)."""

    kind: Literal["fixed", "uniform", "lognormal"]
    a: float
    b: float = 0.0
    cap: int | None = None
    spec: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """Draw `n` lengths, each at least 1."""
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        else:
            values = np.rint(self.a * np.exp(self.b * rng.standard_normal(n)))
            if self.cap is not None:
                values = np.minimum(values, self.cap)
        return [max(1, int(v)) for v in values]

    def __str__(self) -> str:
        return self.spec


def parse_dist(text: str, kind: Kind) -> LengthDist:
    """Parse a DIST string for an input (`kind="input"`) or output length."""
    spec = text.strip()
    if spec in PRESETS:
        resolved = parse_dist(PRESETS[spec][kind], kind)
        return LengthDist(resolved.kind, resolved.a, resolved.b, resolved.cap, spec)
    name, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    try:
        if name.isdigit() and not args:
            return _checked(LengthDist("fixed", int(name), spec=spec))
        if name == "fixed" and len(args) == 1:
            return _checked(LengthDist("fixed", int(args[0]), spec=spec))
        if name == "uniform" and len(args) == 2:
            return _checked(LengthDist("uniform", int(args[0]), int(args[1]), spec=spec))
        if name == "lognormal" and len(args) in (2, 3):
            cap = int(args[2]) if len(args) == 3 else None
            return _checked(LengthDist("lognormal", float(args[0]), float(args[1]), cap, spec))
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from exc
    presets = ", ".join(PRESETS)
    raise ValueError(
        f"bad length distribution {spec!r}: expected fixed:N, uniform:LO:HI, "
        f"lognormal:MEDIAN:SIGMA[:CAP] or a preset ({presets})"
    )


def _checked(dist: LengthDist) -> LengthDist:
    if dist.a < 1:
        raise ValueError("lengths must be at least 1")
    if dist.kind == "uniform" and dist.b < dist.a:
        raise ValueError("uniform needs LO <= HI")
    if dist.kind == "lognormal" and (dist.b < 0 or (dist.cap is not None and dist.cap < 1)):
        raise ValueError("lognormal needs SIGMA >= 0 and CAP >= 1")
    return dist


def parse_rate(text: str) -> float:
    """A request rate in req/s: a positive number, or `inf` for a burst."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"rate must be positive or inf, got {text!r}")
    return value


def parse_rates(text: str) -> list[float]:
    """A comma-separated list of rates, e.g. `1,2,4,inf`."""
    rates = [parse_rate(part) for part in text.split(",") if part.strip()]
    if not rates:
        raise ValueError("no rates given")
    return rates


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds after the start for `n` requests (the first at 0).

    The gaps are drawn as standard Gamma(K) / K, then divided by the rate, so one seed gives
    the same pattern, stretched, at every rate of a sweep.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])
    gaps = rng.standard_gamma(burstiness, size=n - 1) / burstiness / rate
    return [0.0, *np.cumsum(gaps).tolist()]


def synthetic_prompt(rng: np.random.Generator, num_tokens: int) -> str:
    """About `num_tokens` tokens of text: that many random words from `WORDS`."""
    picks = rng.integers(0, len(WORDS), size=num_tokens)
    return " ".join(WORDS[i] for i in picks)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: a prompt (or chat messages) and its output length.

    A replayed request (bench/replay.py) carries its whole `body` and its `endpoint` instead.
    """

    index: int
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    target_input_len: int | None = None
    body: dict[str, Any] | None = None
    endpoint: Literal["chat", "completions", "responses"] | None = None
    #: multi-turn: the conversation, and this request's turn in it (1 = sent on schedule;
    #: a later turn carries only its new messages, the client prepends the history)
    conversation: int | None = None
    turn: int = 1
    #: the body's `user` (`--users`) and the `X-Carousel-Deadline-Ms` header (`--deadline-mix`)
    user: str | None = None
    deadline_ms: float | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        """The chat form: the dataset's messages, or the prompt as one user message."""
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt or ""}]

    def as_prompt(self) -> str:
        """The completions form: the prompt, or the messages' text contents joined."""
        if self.prompt is not None:
            return self.prompt
        parts = [m.get("content") for m in self.messages or []]
        return "\n".join(p for p in parts if isinstance(p, str))


@dataclass(frozen=True)
class DatasetEntry:
    """One line of a JSONL dataset."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None


def load_dataset(path: str | Path) -> list[DatasetEntry]:
    """Read `{"prompt": str}` or `{"messages": [...]}` lines, each with optional "max_tokens".

    Blank lines are skipped; anything else malformed raises ValueError naming the line.
    """
    entries: list[DatasetEntry] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entries.append(_parse_entry(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    if not entries:
        raise ValueError(f"{path}: no requests in dataset")
    return entries


def _parse_entry(obj: Any) -> DatasetEntry:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    prompt, messages, max_tokens = obj.get("prompt"), obj.get("messages"), obj.get("max_tokens")
    if (prompt is None) == (messages is None):
        raise ValueError('each line needs exactly one of "prompt" or "messages"')
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError('"prompt" must be a string')
    if messages is not None and not (
        isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    ):
        raise ValueError('"messages" must be a non-empty list of objects')
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError('"max_tokens" must be a positive integer')
    return DatasetEntry(prompt, messages, max_tokens)


def build_workload(
    num_requests: int,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int,
    dataset: list[DatasetEntry] | None = None,
) -> list[RequestSpec]:
    """The requests of a run: synthetic, or the dataset's lines in order (cycled if short).

    A dataset line without "max_tokens" takes its output length from `output_len`.
    """
    outputs = output_len.sample(np.random.default_rng([seed, 2]), num_requests)
    if dataset is not None:
        specs = []
        for i in range(num_requests):
            entry = dataset[i % len(dataset)]
            max_tokens = entry.max_tokens if entry.max_tokens is not None else outputs[i]
            specs.append(RequestSpec(i, max_tokens, entry.prompt, entry.messages))
        return specs
    inputs = input_len.sample(np.random.default_rng([seed, 3]), num_requests)
    text_rng = np.random.default_rng([seed, 4])
    return [
        RequestSpec(i, outputs[i], synthetic_prompt(text_rng, inputs[i]), None, inputs[i])
        for i in range(num_requests)
    ]


def build_conversations(
    num_conversations: int, turns: int, input_len: LengthDist, output_len: LengthDist, seed: int
) -> list[RequestSpec]:
    """`num_conversations` conversations of `turns` synthetic questions each, in order."""
    n = num_conversations * turns
    inputs = input_len.sample(np.random.default_rng([seed, 3]), n)
    outputs = output_len.sample(np.random.default_rng([seed, 2]), n)
    text_rng = np.random.default_rng([seed, 4])
    return [
        RequestSpec(
            index=i,
            max_tokens=outputs[i],
            messages=[{"role": "user", "content": synthetic_prompt(text_rng, inputs[i])}],
            target_input_len=inputs[i],
            conversation=i // turns,
            turn=i % turns + 1,
        )
        for i in range(n)
    ]


def add_shared_prefix(specs: list[RequestSpec], prefix_len: int, seed: int) -> list[RequestSpec]:
    """Every conversation's first request starts with one shared `prefix_len`-word system
    prompt (a later turn has it in its history already)."""
    system = {
        "role": "system",
        "content": synthetic_prompt(np.random.default_rng([seed, 5]), prefix_len),
    }
    return [
        dataclasses.replace(
            spec,
            prompt=None,
            messages=[system, *spec.as_messages()],
            target_input_len=None
            if spec.target_input_len is None
            else spec.target_input_len + prefix_len,
        )
        if spec.turn == 1
        else spec
        for spec in specs
    ]


def num_arrivals(specs: list[RequestSpec]) -> int:
    """Requests sent on the arrival schedule: every one but the later turns of a conversation."""
    return sum(spec.turn == 1 for spec in specs)


def spread_offsets(specs: list[RequestSpec], offsets: list[float]) -> list[float]:
    """One send time per spec from one per arrival: a later turn gets its conversation's
    (the client sends it when the previous answer arrived, not at that time)."""
    per_spec: list[float] = []
    arrivals = iter(offsets)
    for spec in specs:
        per_spec.append(next(arrivals) if spec.turn == 1 else per_spec[-1])
    return per_spec


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`heavy:9,light:1` -> [("heavy", 0.9), ("light", 0.1)]: values and their shares."""
    mix: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        value, sep, share = part.rpartition(":")
        if not sep or not value or not float(share) > 0:
            raise ValueError(f"expected VALUE:SHARE with a positive share, got {part!r}")
        mix.append((value, float(share)))
    if not mix:
        raise ValueError("an empty mix")
    total = sum(share for _, share in mix)
    return [(value, share / total) for value, share in mix]


def parse_deadline_mix(text: str) -> list[tuple[str, float]]:
    """A mix of deadlines in ms, e.g. `300:1,5000:1`; ValueError unless each is positive."""
    mix = parse_mix(text)
    for value, _ in mix:
        if not float(value) > 0:
            raise ValueError(f"a deadline must be a positive number of ms, got {value!r}")
    return mix


def assign_mix(
    specs: list[RequestSpec],
    seed: int,
    users: list[tuple[str, float]] | None = None,
    deadlines: list[tuple[str, float]] | None = None,
) -> list[RequestSpec]:
    """Each request's `user` and `deadline_ms`, drawn by share with `seed`."""
    rng = np.random.default_rng([seed, 5])
    out = []
    for spec in specs:
        changes: dict[str, Any] = {}
        if users:
            changes["user"] = users[rng.choice(len(users), p=[s for _, s in users])][0]
        if deadlines:
            pick = rng.choice(len(deadlines), p=[s for _, s in deadlines])
            changes["deadline_ms"] = float(deadlines[pick][0])
        out.append(dataclasses.replace(spec, **changes) if changes else spec)
    return out
