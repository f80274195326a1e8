"""The numbers a run reports, with vLLM `bench serve` definitions so they read the same.

Per request (clock started just before the HTTP request is sent):

- TTFT, time to first token: until the first stream chunk that carries generated text
  (a chat `delta.content` or a completion `text` that is not empty). The role-only first chunk
  of a chat stream does not count: it says nothing about generation.
- E2E latency: until the stream ends (`data: [DONE]`, or the connection closing).
- Output tokens: `usage.completion_tokens` from the final usage chunk (the bench always asks
  for it with `stream_options.include_usage`); when the server sends none, the number of
  content chunks.
- TPOT, time per output token after the first: (latency - TTFT) / (output tokens - 1).
  Requests with fewer than 2 output tokens have no TPOT and are left out of its statistics.
- ITL, inter-token latency: every gap between consecutive content chunks. A server that
  packs several tokens into one chunk shows fewer, larger gaps.

Per run (one arm at one rate), over the requests that completed:

- duration: from the first request's scheduled send to the end of the last one.
- request throughput = completed / duration; output token throughput = sum of output tokens
  / duration; total token throughput = (prompt + output tokens) / duration, with prompt
  tokens as the server reported them in `usage`.
- goodput = requests meeting every SLO given (TTFT <= `--slo-ttft` ms, TPOT <= `--slo-tpot`
  ms, or `--slo ttft=2s,tpot=200ms`) / duration. A request without a TPOT (one output token)
  meets the TPOT SLO; one without a TTFT (no text at all) misses the TTFT SLO. `None` when no
  SLO is given. goodput_share = those requests / (completed + failed): a failed request
  misses its SLO. The verdict compares the share (bench/verdict.py).
- For TTFT, TPOT, ITL and E2E: mean, p50, p90, p99 in milliseconds (numpy's linear
  interpolation between order statistics); `None` when there are no samples.
- client CPU: the bench process's own CPU seconds over the run (`time.process_time`): the
  load the client put on a machine it shares with the server. A faster server takes the
  same client work in less time, so on a small shared machine the client weighs on it more.
- failed: requests that got an HTTP error status, an in-stream `error` event, or a transport
  error or timeout. cancelled: requests in flight when the run was interrupted (Ctrl-C);
  neither counts in the statistics above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.client import RequestResult

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; `None` means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


_SLO_UNITS = {"ms": 1.0, "s": 1000.0, "us": 0.001}
_SLO_PART = re.compile(r"^\s*(ttft|tpot)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


def parse_slo(text: str) -> Slo:
    """`ttft=2s,tpot=200ms` -> Slo(2000, 200). Units ms (the default), s or us."""
    found: dict[str, float] = {}
    for part in text.split(","):
        match = _SLO_PART.match(part)
        if match is None:
            raise ValueError(
                f"bad SLO {part.strip()!r}: expected ttft=VALUE or tpot=VALUE, e.g. ttft=2s"
            )
        key, number, unit = match.groups()
        if key in found:
            raise ValueError(f"{key} is given twice")
        value = float(number) * _SLO_UNITS[unit or "ms"]
        if value <= 0:
            raise ValueError(f"{key} must be positive")
        found[key] = value
    return Slo(found.get("ttft"), found.get("tpot"))


def tpot(result: RequestResult) -> float | None:
    """(latency - TTFT) / (output tokens - 1), in seconds; `None` below 2 output tokens."""
    if result.latency is None or result.ttft is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of seconds, reported in milliseconds."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    stats = [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))]
    return dict(zip(keys, stats, strict=True))


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Whether a completed request met every SLO given; a request's own deadline
    (`--deadline-mix`) replaces the TTFT objective."""
    ttft_ms = result.deadline_ms if result.deadline_ms is not None else slo.ttft_ms
    if ttft_ms is not None and (result.ttft is None or result.ttft * 1000 > ttft_ms):
        return False
    per_token = tpot(result)
    return slo.tpot_ms is None or per_token is None or per_token * 1000 <= slo.tpot_ms


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    slo: Slo | None = None,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    """The run's metrics (see the module docstring), as a JSON-ready dict."""
    slo = slo or Slo()
    done = [r for r in results if r.success]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    good = sum(meets_slo(r, slo) for r in done) if slo.active else None
    tpots = [t for t in map(tpot, done) if t is not None]
    return {
        "num_sent": len(results),
        "completed": len(done),
        "failed": sum(r.error is not None for r in results),
        "cancelled": sum(r.cancelled for r in results),
        "duration_s": duration_s,
        "client_cpu_s": client_cpu_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "good_requests": good,
        "goodput": None if good is None else good * per_s,
        "goodput_share": _share(good, len(done) + sum(r.error is not None for r in results)),
        "ttft_ms": summarize([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": summarize(tpots),
        "itl_ms": summarize([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": summarize([r.latency for r in done if r.latency is not None]),
    }


def _share(good: int | None, finished: int) -> float | None:
    return None if good is None or finished == 0 else good / finished


def error_counts(results: list[RequestResult], limit: int = 10) -> dict[str, int]:
    """The most frequent error messages and how often each occurred."""
    counts: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            counts[r.error] = counts.get(r.error, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return dict(top)


def prefix_cache_summary(results: list[RequestResult]) -> dict[str, Any]:
    """How much of the prompts the server's prefix cache served, over completed requests.

    `hit_rate` = cached / prompt tokens, both from usage (`prompt_tokens_details.
    cached_tokens`); None when the server reported no cached counts. With multi-turn
    conversations, TTFT of first turns and of later turns (ms), apart.
    """
    done = [r for r in results if r.success and r.prompt_tokens is not None]
    reported = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    first = [r.ttft for r in done if r.turn == 1 and r.ttft is not None]
    later = [r.ttft for r in done if r.turn is not None and r.turn > 1 and r.ttft is not None]
    return {
        "hit_rate": cached / prompt if reported and prompt else None,
        "cached_tokens": cached if reported else None,
        "prompt_tokens": prompt if reported else None,
        "ttft_ms_first_turns": summarize(first) if later else None,
        "ttft_ms_later_turns": summarize(later) if later else None,
    }
