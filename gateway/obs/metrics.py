"""Prometheus metrics of one app (its own registry, so several apps can share a process).

Names follow vLLM's where one exists (`num_requests_running`, `prompt_tokens_total`,
`time_to_first_token_seconds`, ...) with a `carousel_` prefix; every series carries the
served `model` and the `arm` that served it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.obs.kv_capacity import KVCapacity
from gateway.obs.spec_metrics import SpecDecodeCounters
from schedulers.load_phase import KERNELS_BUILDING, KERNELS_CAROUSEL

if TYPE_CHECKING:
    from schedulers.engine import Engine
    from schedulers.outputs import IterationRecord
    from schedulers.sequence import Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RequestFacts(Protocol):
    """What a finished request's series are made of (a `RequestContext` is one)."""

    @property
    def model(self) -> str: ...
    @property
    def arm(self) -> str | None: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def finish_reasons(self) -> list[str]: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def itl_s(self) -> list[float]: ...


@dataclass(frozen=True)
class ArmGauges:
    """A point-in-time view of one arm's engine, read at scrape time."""

    model: str
    arm: str
    num_running: int
    num_waiting: int
    kv_usage: float
    #: KV blocks no sequence holds that keep a cached prefix, as a share of all blocks
    kv_cached: float = 0.0
    #: resident weight bytes per format (`bfloat16`, `int4`, `int8`; none for the sim)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    #: what the engine's KV cache holds (gateway/obs/kv_capacity.py)
    kv_capacity: KVCapacity | None = None
    #: which ops serve its CPU forward (`torch`, `building`, `carousel`); None: not a CPU one
    serving_kernels: str | None = None


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
            "kv_cached": GaugeMetricFamily(
                "carousel_prefix_cache_blocks_perc",
                "KV blocks no sequence holds that keep a cached prefix for reuse (0..1)",
                labels=["model", "arm"],
            ),
        }
        weights = GaugeMetricFamily(
            "carousel_weight_bytes",
            "Resident model weight bytes, per format (a quantised copy is one more format)",
            labels=["model", "arm", "format"],
        )
        capacity = _KVCapacityFamilies()
        kernels = _KernelFamilies()
        for gauges in self._read():
            for attr, family in families.items():
                family.add_metric([gauges.model, gauges.arm], float(getattr(gauges, attr)))
            for fmt, nbytes in gauges.weight_bytes.items():
                weights.add_metric([gauges.model, gauges.arm, fmt], float(nbytes))
            if gauges.kv_capacity is not None:
                capacity.add(gauges.model, gauges.arm, gauges.kv_capacity)
            if gauges.serving_kernels is not None:
                kernels.add(gauges.model, gauges.arm, gauges.serving_kernels)
        yield from families.values()
        yield weights
        yield from capacity.families()
        yield from kernels.families()


class _KernelFamilies:
    """Which ops serve each local arm's CPU forward: Carousel's kernels (1) or torch's (0),
    and whether the kernels are still building in the background (runner/kernel_switch.py)."""

    def __init__(self) -> None:
        self.serving = GaugeMetricFamily(
            "carousel_cpu_kernels_serving",
            "1 where Carousel's CPU kernels serve the arm's forward, 0 where torch's ops do",
            labels=["model", "arm"],
        )
        self.building = GaugeMetricFamily(
            "carousel_cpu_kernels_building",
            "1 while the arm serves on torch's ops and its CPU kernels build in the background",
            labels=["model", "arm"],
        )

    def add(self, model: str, arm: str, kernels: str) -> None:
        self.serving.add_metric([model, arm], float(kernels == KERNELS_CAROUSEL))
        self.building.add_metric([model, arm], float(kernels == KERNELS_BUILDING))

    def families(self) -> list[Metric]:
        return [self.serving, self.building]


class _KVCapacityFamilies:
    """The KV cache's size and what it holds at once, per arm (the start-up `kv_cache` line's
    figures; gateway/obs/kv_capacity.py says how the concurrency is computed)."""

    def __init__(self) -> None:
        labels = ["model", "arm"]
        self.blocks = GaugeMetricFamily(
            "carousel_kv_cache_blocks", "KV cache blocks the engine allocated", labels=labels
        )
        self.block_size = GaugeMetricFamily(
            "carousel_kv_cache_block_size", "Token slots per KV cache block", labels=labels
        )
        self.tokens = GaugeMetricFamily(
            "carousel_kv_cache_tokens", "Token slots of the whole KV cache", labels=labels
        )
        self.nbytes = GaugeMetricFamily(
            "carousel_kv_cache_bytes",
            "Bytes of the KV cache's K and V tensors on one device (a tensor-parallel rank's "
            "share; none for the sim)",
            labels=labels,
        )
        self.concurrency = GaugeMetricFamily(
            "carousel_kv_cache_max_concurrency",
            "Requests of context_tokens tokens the KV cache holds at once (vLLM's 'Maximum "
            "concurrency'), at max_model_len and at a typical 2048-token context",
            labels=[*labels, "context_tokens"],
        )

    def add(self, model: str, arm: str, capacity: KVCapacity) -> None:
        self.blocks.add_metric([model, arm], float(capacity.num_blocks))
        self.block_size.add_metric([model, arm], float(capacity.block_size))
        self.tokens.add_metric([model, arm], float(capacity.num_tokens))
        if capacity.nbytes:
            self.nbytes.add_metric([model, arm], float(capacity.nbytes))
        contexts = {capacity.max_model_len, capacity.typical_context_tokens}
        for context in sorted(contexts):
            value = capacity.max_concurrency(context)
            self.concurrency.add_metric([model, arm, str(context)], value)

    def families(self) -> list[Metric]:
        return [self.blocks, self.block_size, self.tokens, self.nbytes, self.concurrency]


@dataclass(frozen=True)
class ArmInfo:
    """What an arm is and which device it computes on, exported as `carousel_arm_info` = 1.

    `kind` is "local" or "upstream"; arms with one `device_group` compete for one device
    (`carousel ab report` calls a live comparison of such arms confounded when both were busy
    at once). Use `local_device_group()` for local arms, `upstream_device_group(url)` for
    upstream ones.
    """

    model: str
    arm: str
    kind: str
    device_group: str


def local_device_group() -> str:
    """The group of every local arm of this process: they share its one device thread.

    NOTE: no hostname or pid: a /metrics scrape is one process, and labels are public."""
    return "local"


def upstream_device_group(base_url: str) -> str:
    return f"upstream:{base_url.rstrip('/')}"


class _ArmInfoCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[ArmInfo]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "carousel_arm_info",
            "Each arm's kind and device group (1 per arm)",
            labels=["model", "arm", "kind", "device_group"],
        )
        for info in self._read():
            family.add_metric([info.model, info.arm, info.kind, info.device_group], 1.0)
        yield family


class _TrafficRecordCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        written, dropped = self._counts()
        yield CounterMetricFamily(
            "carousel_traffic_record_written", "Requests written to the traffic record", written
        )
        yield CounterMetricFamily(
            "carousel_traffic_record_dropped",
            "Requests the traffic record lost (queue full or write failed)",
            dropped,
        )


_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class GatewayMetrics:
    """Request-level series the gateway updates once per request, and engine-level series
    each local arm's engine feeds every iteration (`watch_engine`)."""

    def __init__(
        self,
        arm_gauges: Callable[[], Iterable[ArmGauges]] | None = None,
        arm_info: Callable[[], Iterable[ArmInfo]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "arm"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.requests = counter(
            "carousel_requests", "HTTP requests to the OpenAI endpoints", ("endpoint", "status")
        )
        self.request_success = counter(
            "carousel_request_success", "Choices finished, by finish reason", ("finished_reason",)
        )
        self.prompt_tokens = counter("carousel_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("carousel_generation_tokens", "Tokens generated")
        self.ttft = histogram(
            "carousel_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "carousel_inter_token_latency_seconds",
            "Gap between successive token deliveries of one request",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "carousel_e2e_request_latency_seconds",
            "Time from request arrival to its last byte",
            _LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "carousel_request_queue_time_seconds",
            "Time a sequence waited in the engine before its first iteration",
            _LATENCY_BUCKETS,
        )
        self.preemptions = counter(
            "carousel_num_preemptions", "Sequences preempted for lack of KV blocks"
        )
        self.iteration_batch_size = histogram(
            "carousel_iteration_batch_size", "Sequences in one engine iteration", _BATCH_BUCKETS
        )
        self.iteration_tokens = histogram(
            "carousel_iteration_tokens", "Tokens computed in one engine iteration", _TOKEN_BUCKETS
        )
        self.iterations = counter("carousel_iterations", "Engine iterations run")
        self.shadow_dropped = counter(
            "carousel_shadow_requests_dropped",
            "Copies for a shadow arm dropped because its queue was full",
        )
        self.prefix_cache_queries = counter(
            "carousel_prefix_cache_queries",
            "Tokens of the sequences admitted, looked up in the prefix cache",
        )
        self.prefix_cache_hits = counter(
            "carousel_prefix_cache_hits",
            "Tokens of the sequences admitted, served from the prefix cache",
        )
        self._spec: SpecDecodeCounters | None = None
        if arm_gauges is not None:
            self.registry.register(_ArmCollector(arm_gauges))
        if arm_info is not None:  # not wired: no carousel_arm_info series at all
            self.registry.register(_ArmInfoCollector(arm_info))

    def watch_traffic_record(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Export the traffic record's (written, dropped) line counts, read at scrape time."""
        self.registry.register(_TrafficRecordCollector(counts))

    def observe_request(self, ctx: RequestFacts, status: int, total_s: float) -> None:
        labels = (ctx.model or "", ctx.arm or "")
        self.requests.labels(*labels, ctx.endpoint, str(status)).inc()
        if ctx.arm is None:
            return
        self.prompt_tokens.labels(*labels).inc(ctx.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(ctx.completion_tokens)
        for reason in ctx.finish_reasons:
            self.request_success.labels(*labels, reason).inc()
        if ctx.ttft_s is not None:
            self.ttft.labels(*labels).observe(ctx.ttft_s)
        itl = self.itl.labels(*labels)
        for gap in ctx.itl_s:
            itl.observe(gap)
        if status == 200:
            self.e2e.labels(*labels).observe(total_s)

    def watch_engine(self, engine: Engine, model: str, arm: str) -> None:
        """Feed this engine's iterations and finished sequences into the arm's series.

        NOTE: the listeners run on the engine thread; prometheus_client is thread-safe.
        """
        batch_size = self.iteration_batch_size.labels(model, arm)
        tokens = self.iteration_tokens.labels(model, arm)
        preemptions = self.preemptions.labels(model, arm)
        iterations = self.iterations.labels(model, arm)
        queue_time = self.queue_time.labels(model, arm)
        queries = self.prefix_cache_queries.labels(model, arm)
        hits = self.prefix_cache_hits.labels(model, arm)
        block_manager = engine.block_manager
        seen = [block_manager.prefix_cache_queries, block_manager.prefix_cache_hits]

        def on_iteration(record: IterationRecord) -> None:
            iterations.inc()
            batch_size.observe(record.batch_size)
            tokens.observe(record.num_tokens)
            if record.num_preempted:
                preemptions.inc(record.num_preempted)
            now = [block_manager.prefix_cache_queries, block_manager.prefix_cache_hits]
            if now != seen:
                queries.inc(now[0] - seen[0])
                hits.inc(now[1] - seen[1])
                seen[:] = now

        def on_finish(seq: Sequence) -> None:
            if seq.first_scheduled_time is not None:
                queue_time.observe(seq.first_scheduled_time - seq.arrival_time)

        engine.iteration_listeners.append(on_iteration)
        engine.finish_listeners.append(on_finish)
        drafter = engine.scheduler.drafter
        if drafter is not None:  # registered on first use: no series without speculation
            if self._spec is None:
                self._spec = SpecDecodeCounters(self.registry)
            engine.iteration_listeners.append(self._spec.listener(drafter.stats, model, arm))

    def render(self) -> bytes:
        return generate_latest(self.registry)
