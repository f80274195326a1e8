"""Prometheus metrics of one app (its own registry, so several apps can share a process).

Names follow vLLM's where one exists (`num_requests_running`, `prompt_tokens_total`,
`time_to_first_token_seconds`, ...) with a `carousel_` prefix; every series carries the
served `model` and the `arm` that served it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.context import RequestContext

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class ArmGauges:
    """A point-in-time view of one arm's engine, read at scrape time."""

    model: str
    arm: str
    num_running: int
    num_waiting: int
    kv_usage: float


class _ArmCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[ArmGauges]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        families = {
            "num_running": GaugeMetricFamily(
                "carousel_num_requests_running", "Sequences running", labels=["model", "arm"]
            ),
            "num_waiting": GaugeMetricFamily(
                "carousel_num_requests_waiting", "Sequences waiting", labels=["model", "arm"]
            ),
            "kv_usage": GaugeMetricFamily(
                "carousel_kv_cache_usage_perc", "KV cache usage (0..1)", labels=["model", "arm"]
            ),
        }
        for gauges in self._read():
            for attr, family in families.items():
                family.add_metric([gauges.model, gauges.arm], float(getattr(gauges, attr)))
        yield from families.values()


class GatewayMetrics:
    """Counters and histograms the gateway updates once per request."""

    def __init__(self, arm_gauges: Callable[[], Iterable[ArmGauges]] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "arm"]
        self.requests = Counter(
            "carousel_requests",
            "HTTP requests to the OpenAI endpoints by status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.request_success = Counter(
            "carousel_request_success",
            "Choices finished, by finish reason",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "carousel_prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "carousel_generation_tokens", "Tokens generated", labels, registry=self.registry
        )
        self.ttft = Histogram(
            "carousel_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "carousel_e2e_request_latency_seconds",
            "Time from request arrival to its last byte",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        if arm_gauges is not None:
            self.registry.register(_ArmCollector(arm_gauges))

    def observe_request(self, ctx: RequestContext, status: int, total_s: float) -> None:
        self.requests.labels(ctx.endpoint, str(status)).inc()
        if ctx.arm is None:
            return
        labels = (ctx.model, ctx.arm)
        self.prompt_tokens.labels(*labels).inc(ctx.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(ctx.completion_tokens)
        for reason in ctx.finish_reasons:
            self.request_success.labels(*labels, reason).inc()
        if ctx.ttft_s is not None:
            self.ttft.labels(*labels).observe(ctx.ttft_s)
        if status == 200:
            self.e2e.labels(*labels).observe(total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
