"""`--speculative-config`: vLLM's JSON spelling, parsed into one frozen `SpeculativeConfig`.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}` as vLLM reads it (vllm/config/speculative.py), plus the adaptive
policy's knobs (policy.py), spelled as SGLang's `--speculative-adaptive` config and
TensorRT-LLM's `max_concurrency` where those name the same thing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

#: the most draft tokens one sequence verifies in a step (vLLM's `MAX_SPEC_LEN`)
MAX_SPEC_LEN = 32
#: vLLM's n-gram window when neither bound is given (its TODO calls the value arbitrary)
DEFAULT_PROMPT_LOOKUP = 5
#: the methods Carousel runs
METHODS = ("ngram",)
#: vLLM's names of methods that need a draft model or head: refused by name, not as unknown
_MODEL_METHODS = frozenset(
    {"eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp", "suffix", "ngram_gpu"}
)
#: vLLM's spellings of the n-gram method (`model: "[ngram]"` is how older vLLM named it)
_NGRAM_ALIASES = frozenset({"ngram", "[ngram]"})
#: the adaptive policy's `max_concurrency` where the config names none (`"max_concurrency":
#: null` keeps drafting at any load): above this many decoding sequences no realistic
#: acceptance pays for the drafts' rows on the machine it was measured on (MEASURED_BASIS)
ADAPTIVE_MAX_CONCURRENCY = 32
#: where ADAPTIVE_MAX_CONCURRENCY and the adaptive knobs' defaults were measured
MEASURED_BASIS = (
    "OMP_NUM_THREADS=1 .venv/bin/python scripts/spec_thresholds.py --rounds 9 on an "
    "'Intel(R) Xeon(R) Processor' (lscpu; AMX), 2 shared cores at a load average of 11-14 "
    "from other work, 2026-12-07; median wall and median CPU time per step agree"
)
#: keys that only the adaptive policy reads
_ADAPTIVE_KEYS = (
    "ema_alpha",
    "up_hysteresis",
    "down_hysteresis",
    "probe_backoff_steps",
    "max_probe_backoff_steps",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with prompt-lookup drafts, for one arm.

    `num_speculative_tokens` (k) is the most draft tokens a sequence verifies per step;
    drafts are the tokens that followed the longest earlier occurrence of the sequence's last
    `prompt_lookup_min`..`prompt_lookup_max` tokens (ngram.py). The constructor takes resolved
    values; `from_dict` applies vLLM's defaults (both bounds 5 when neither is given, else the
    missing one equal to the other).

    `adaptive` (SGLang's `--speculative-adaptive`) sets each sequence's k from an EMA of its
    accepted draft tokens per verified step (`ema_alpha`), stepping up or down one token at a
    time with SGLang's margins `up_hysteresis` / `down_hysteresis`; a sequence whose EMA falls
    to `0.5 + down_hysteresis` stops drafting and is re-probed after `probe_backoff_steps`
    steps, doubling per failed probe up to `max_probe_backoff_steps` (acceptance.py).
    Without it every sequence drafts k tokens, as vLLM does.

    `max_concurrency` (TensorRT-LLM's name): above this many decoding sequences in a step,
    no sequence drafts; drafting resumes at `max_concurrency - concurrency_hysteresis` or
    fewer, and the switch never flips twice within `min_switch_steps` steps (load_switch.py).
    None: drafting at any load (vLLM's behaviour, the default without `adaptive`); with
    `adaptive` and no value given, `from_dict` sets the measured ADAPTIVE_MAX_CONCURRENCY.

    Measured basis (MEASURED_BASIS, docs/speculative-decoding.md "Where it pays"): the cost
    of a step whose B rows each verify k drafts against B plain rows, t(B, k) / t(B, 0), on the
    default model served as by default (`quantization auto`: int4 up to R = 8 rows, so a
    verifying step of B >= 2 rows at k = 4 runs bf16). At a per-draft acceptance of 0.8 (the
    grounded-edit single stream's 66% of 4 drafts) k = 4 drafts yield 2.36 accepted tokens:
    they pay up to B = 32 (x2.3-2.4, 1.3-1.4 needed) and not at 64 (x4.7-4.8): hence 32. The
    ladder's rungs (acceptance.py) sit above the measured break-even of their k at B <= 32
    (k = 4 drops at an EMA of 2.25, its break-even 0.5-1.4; k = 3 at 1.25, 0.4-1.0); the off
    threshold 0.5 + `down_hysteresis` = 0.25 lies within k = 1's measured break-even, -0.04
    to 0.5 (median 0.3) across B = 1..32; a failed probe drafts one token every
    `probe_backoff_steps` = 16 steps, at most 1/16 of k = 1's cost (0.5 of a row's step).
    `ema_alpha` and `min_switch_steps` are SGLang's and TensorRT-LLM's, not measured here.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    adaptive: bool = False
    ema_alpha: float = 0.2
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    probe_backoff_steps: int = 16
    max_probe_backoff_steps: int = 256
    max_concurrency: int | None = None
    concurrency_hysteresis: int = 2
    min_switch_steps: int = 8

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid --speculative-config: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """A message for every invalid value; empty when all are valid."""
        out = [message for message in (_method_problem(self.method),) if message]
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPEC_LEN:
            out.append(
                f"num_speculative_tokens must be in [1, {MAX_SPEC_LEN}], got {k} "
                "(leave --speculative-config out to turn speculation off)"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            out.append(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        return out + self._adaptive_problems() + self._load_problems()

    def _adaptive_problems(self) -> list[str]:
        out: list[str] = []
        if not 0.0 < self.ema_alpha <= 1.0:
            out.append(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if not self.down_hysteresis > -0.5:
            out.append(
                "down_hysteresis must be above -0.5 (else k never falls to 0), got "
                f"{self.down_hysteresis}"
            )
        if not self.up_hysteresis < 0.5:
            out.append(
                f"up_hysteresis must be below 0.5 (else k never rises), got {self.up_hysteresis}"
            )
        if self.down_hysteresis > self.up_hysteresis:
            out.append(
                f"down_hysteresis={self.down_hysteresis} must be <= up_hysteresis="
                f"{self.up_hysteresis} (else k bounces between two lengths)"
            )
        if self.probe_backoff_steps < 1:
            out.append(f"probe_backoff_steps must be at least 1, got {self.probe_backoff_steps}")
        if self.max_probe_backoff_steps < self.probe_backoff_steps:
            out.append(
                f"max_probe_backoff_steps={self.max_probe_backoff_steps} must be >= "
                f"probe_backoff_steps={self.probe_backoff_steps}"
            )
        return out

    def _load_problems(self) -> list[str]:
        out: list[str] = []
        cap = self.max_concurrency
        if cap is not None and cap < 1:
            out.append(f"max_concurrency must be at least 1 (or null: no load switch), got {cap}")
        if self.concurrency_hysteresis < 0:
            out.append(
                f"concurrency_hysteresis must be at least 0, got {self.concurrency_hysteresis}"
            )
        elif cap is not None and cap >= 1 and self.concurrency_hysteresis >= cap:
            out.append(
                f"concurrency_hysteresis={self.concurrency_hysteresis} must be below "
                f"max_concurrency={cap} (else drafting never resumes)"
            )
        if self.min_switch_steps < 1:
            out.append(f"min_switch_steps must be at least 1, got {self.min_switch_steps}")
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """The config a `--speculative-config` object spells, with vLLM's defaults applied.

        Raises ValueError naming the key for unknown keys, wrong types, a missing
        `num_speculative_tokens`, adaptive knobs without `"adaptive": true`, and every
        invalid value.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"--speculative-config must be a JSON object, got {type(data).__name__}"
            )
        values = dict(data)
        method = _resolve_method(values.pop("method", None), values.pop("model", None))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))} in --speculative-config; "
                f"known: model, {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in values:
            raise ValueError(
                "--speculative-config needs num_speculative_tokens (the most draft tokens "
                "a sequence verifies per step)"
            )
        for f in fields(cls):
            if f.name in values:
                _check_type(f.name, values[f.name], str(f.type))
        strays = [key for key in _ADAPTIVE_KEYS if key in values]
        if strays and not values.get("adaptive", False):
            raise ValueError(
                f"{', '.join(strays)}: the adaptive policy's knobs, read only with "
                '"adaptive": true'
            )
        if values.get("adaptive", False):
            values.setdefault("max_concurrency", ADAPTIVE_MAX_CONCURRENCY)
        low = values.pop("prompt_lookup_min", None)
        low, high = _lookup_window(low, values.pop("prompt_lookup_max", None))
        return cls(method=method, prompt_lookup_min=low, prompt_lookup_max=high, **values)


def parse_speculative_config(value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """`--speculative-config` as given (a JSON string, a YAML mapping, or nothing) -> the
    config; None (speculation off) for None, an empty string or JSON `null`."""
    data: Any = value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if data is None:
        return None
    return SpeculativeConfig.from_dict(data)


def _method_problem(method: str) -> str | None:
    if method in METHODS:
        return None
    if method in _MODEL_METHODS:
        return (
            f"method {method!r} needs a draft model, which Carousel does not run; "
            "it drafts by prompt lookup: method 'ngram'"
        )
    return f"unknown speculative method {method!r}; supported: {', '.join(METHODS)}"


def _resolve_method(method: Any, model: Any) -> str:
    """The method as vLLM infers it: named, or `model: "ngram"` / `"[ngram]"` without one."""
    if method is None and model is None:
        raise ValueError('--speculative-config needs a method (supported: "ngram")')
    if model is not None and model not in _NGRAM_ALIASES:
        raise ValueError(
            f"model {model!r}: a draft model is not supported; Carousel drafts by prompt "
            'lookup ("method": "ngram")'
        )
    if method is None:
        return "ngram"
    if not isinstance(method, str):
        raise ValueError(f"method must be a string, got {method!r}")
    return "ngram" if method in _NGRAM_ALIASES else method


def _lookup_window(low: int | None, high: int | None) -> tuple[int, int]:
    """vLLM's defaults: both 5 when neither is given, else the missing bound equals the other."""
    if low is None and high is None:
        return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
    if low is None:
        assert high is not None
        return high, high
    return low, low if high is None else high


def _check_type(name: str, value: Any, annotation: str) -> None:
    """Raise ValueError unless `value` has the JSON type the field's annotation names."""
    if value is None and "None" in annotation:
        return
    is_bool = isinstance(value, bool)
    if annotation.startswith("bool"):
        ok, kind = is_bool, "true or false"
    elif annotation.startswith("int"):
        ok, kind = isinstance(value, int) and not is_bool, "an integer"
    elif annotation.startswith("float"):
        ok, kind = isinstance(value, int | float) and not is_bool, "a number"
    else:
        ok, kind = isinstance(value, str), "a string"
    if not ok:
        raise ValueError(f"{name} must be {kind}, got {json.dumps(value)}")
