"""Bench metric maths on synthetic timings with known answers."""

from __future__ import annotations

import pytest

from bench.client import RequestResult
from bench.metrics import Slo, compute_metrics, error_counts, meets_slo, summarize, tpot


def done(
    ttft: float,
    latency: float,
    tokens: int | None,
    itl: list[float] | None = None,
    prompt: int = 10,
    chunks: int = 0,
) -> RequestResult:
    """A successful request with the given timings (seconds)."""
    return RequestResult(
        index=0,
        max_tokens=tokens or 1,
        ttft=ttft,
        latency=latency,
        itl=itl or [],
        usage_output_tokens=tokens,
        num_chunks=chunks,
        prompt_tokens=prompt,
        success=True,
    )


def failed(message: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(index=0, max_tokens=8, error=message)


def test_tpot_spreads_decode_time_over_tokens_after_the_first() -> None:
    assert tpot(done(ttft=0.1, latency=1.1, tokens=11)) == pytest.approx(0.1)


def test_tpot_is_undefined_for_one_or_zero_output_tokens() -> None:
    assert tpot(done(ttft=0.1, latency=0.1, tokens=1)) is None
    assert tpot(done(ttft=0.1, latency=0.2, tokens=0)) is None


def test_output_tokens_fall_back_to_content_chunks_without_usage() -> None:
    result = done(ttft=0.1, latency=0.5, tokens=None, chunks=5)
    assert result.output_tokens == 5
    assert tpot(result) == pytest.approx(0.1)


def test_summarize_reports_milliseconds_with_linear_percentiles() -> None:
    stats = summarize([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)


def test_summarize_of_nothing_is_all_none() -> None:
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_run_metrics_on_known_timings() -> None:
    results = [
        done(ttft=0.1, latency=1.1, tokens=11, itl=[0.1] * 10, prompt=100),
        done(ttft=0.3, latency=2.3, tokens=5, itl=[0.5] * 4, prompt=50),
        done(ttft=0.2, latency=0.2, tokens=1, prompt=20),  # no TPOT, no ITL
        failed(),
    ]
    m = compute_metrics(results, duration_s=4.0)
    assert (m["num_sent"], m["completed"], m["failed"], m["cancelled"]) == (4, 3, 1, 0)
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["total_output_tokens"] == 17
    assert m["output_throughput"] == pytest.approx(17 / 4)
    assert m["total_token_throughput"] == pytest.approx((170 + 17) / 4)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 500) / 2)  # the 1-token request is out
    assert m["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["itl_ms"]["p50"] == pytest.approx(100.0)
    assert m["e2e_latency_ms"]["mean"] == pytest.approx((1100 + 2300 + 200) / 3)
    assert m["e2e_latency_ms"]["p99"] == pytest.approx(1100 + 0.98 * 1200)
    assert m["goodput"] is None and m["good_requests"] is None


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = [
        done(ttft=0.1, latency=1.1, tokens=11),  # ttft 100 ms, tpot 100 ms: good
        done(ttft=0.5, latency=1.5, tokens=11),  # ttft 500 ms: misses TTFT
        done(ttft=0.1, latency=3.1, tokens=11),  # tpot 300 ms: misses TPOT
        done(ttft=0.1, latency=0.1, tokens=1),  # no TPOT: meets it
        failed(),
    ]
    slo = Slo(ttft_ms=200, tpot_ms=150)
    m = compute_metrics(results, duration_s=2.0, slo=slo)
    assert m["good_requests"] == 2
    assert m["goodput"] == pytest.approx(1.0)
    assert m["slo"] == {"ttft_ms": 200, "tpot_ms": 150}


def test_a_single_slo_checks_only_that_objective() -> None:
    slow_decode = done(ttft=0.1, latency=10.1, tokens=11)
    assert meets_slo(slow_decode, Slo(ttft_ms=200))
    assert not meets_slo(slow_decode, Slo(tpot_ms=200))
    no_text = RequestResult(index=0, max_tokens=4, latency=0.1, success=True)
    assert not meets_slo(no_text, Slo(ttft_ms=200))


def test_cancelled_requests_are_neither_completed_nor_failed() -> None:
    cancelled = RequestResult(index=1, max_tokens=8, send_time=0.0, cancelled=True)
    m = compute_metrics([done(0.1, 0.5, 3), cancelled], duration_s=1.0)
    assert (m["completed"], m["failed"], m["cancelled"]) == (1, 0, 1)


def test_zero_duration_gives_zero_throughput_not_an_error() -> None:
    m = compute_metrics([], duration_s=0.0)
    assert m["request_throughput"] == 0 and m["ttft_ms"]["p99"] is None


def test_error_counts_are_most_frequent_first() -> None:
    results = [failed("a"), failed("b"), failed("b"), done(0.1, 0.2, 2)]
    assert list(error_counts(results).items()) == [("b", 2), ("a", 1)]
