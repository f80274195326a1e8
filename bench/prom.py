"""Reading a live Carousel's per-arm series: a `/metrics` scrape, or a Prometheus server's API.

A `Scrape` holds, per (model, arm), each histogram's per-bucket counts, the gauges and
counters, and the `carousel_arm_info` series. Two scrapes subtract (`Scrape.since`), so a window
can be measured without Prometheus; with Prometheus, `increase(...[window])` gives the window's
bucket counts directly, and a range query gives `carousel_num_requests_running` over it.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, str]  # (model, arm)
TTFT = "carousel_time_to_first_token_seconds"
ITL = "carousel_inter_token_latency_seconds"
E2E = "carousel_e2e_request_latency_seconds"
RUNNING = "carousel_num_requests_running"
ITERATIONS = "carousel_iterations_total"
ARM_INFO = "carousel_arm_info"
#: 1 while an arm serves on torch's ops and its CPU kernels build (bench/kernels_wait.py)
KERNELS_BUILDING = "carousel_cpu_kernels_building"
HISTOGRAMS = (TTFT, ITL, E2E)
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """`90s`, `15m`, `1h`, `2d`, or a number of seconds -> seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"bad duration {text!r}: expected e.g. 90s, 15m, 1h or 2d")
    seconds = float(match.group(1)) * _SECONDS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


@dataclass
class Histogram:
    """Per-bucket counts (not cumulative) over upper bounds ending in +Inf."""

    bounds: np.ndarray  # (K,)
    counts: np.ndarray  # (K,)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @classmethod
    def from_cumulative(cls, buckets: dict[float, float]) -> Histogram:
        bounds = np.array(sorted(buckets))
        cumulative = np.array([buckets[b] for b in bounds])
        counts = np.diff(cumulative, prepend=0.0)
        return cls(bounds, np.rint(np.maximum(counts, 0)).astype(np.int64))


@dataclass
class Scrape:
    """One read of the per-arm series, taken at `time` (Unix seconds)."""

    time: float
    histograms: dict[str, dict[Key, Histogram]] = field(default_factory=dict)
    values: dict[str, dict[Key, float]] = field(default_factory=dict)  # gauges and counters
    arm_info: list[dict[str, str]] = field(default_factory=list)

    def models(self) -> list[str]:
        keys = {k for family in self.histograms.values() for k in family}
        keys |= {k for family in self.values.values() for k in family}
        return sorted({model for model, _ in keys} | {i["model"] for i in self.arm_info})

    def arms(self, model: str) -> list[str]:
        """The model's arms: in `carousel_arm_info` order, then any others by name."""
        listed = [i["arm"] for i in self.arm_info if i["model"] == model]
        seen = {arm for family in self.histograms.values() for m, arm in family if m == model}
        seen |= {arm for family in self.values.values() for m, arm in family if m == model}
        return list(dict.fromkeys(listed)) + sorted(seen - set(listed) - {""})

    def since(self, earlier: Scrape) -> Scrape:
        """This scrape's histograms and counters minus `earlier`'s (the window between them).

        NOTE: a series whose counts went down (the server restarted) keeps this scrape's counts.
        """
        diff = Scrape(self.time, values=dict(self.values), arm_info=self.arm_info)
        for name, family in self.histograms.items():
            diff.histograms[name] = {}
            for key, hist in family.items():
                old = earlier.histograms.get(name, {}).get(key)
                same = old is not None and np.array_equal(old.bounds, hist.bounds)
                counts = hist.counts - old.counts if same and old is not None else hist.counts
                if (counts < 0).any():
                    counts = hist.counts
                diff.histograms[name][key] = Histogram(hist.bounds, counts)
        iterations = self.values.get(ITERATIONS, {})
        before = earlier.values.get(ITERATIONS, {})
        diff.values[ITERATIONS] = {
            k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v
            for k, v in iterations.items()
        }
        return diff


def parse_exposition(text: str, at: float | None = None) -> Scrape:
    """A Prometheus text exposition -> `Scrape` (only the series the verdict reads)."""
    scrape = Scrape(time.time() if at is None else at)
    buckets: dict[str, dict[Key, dict[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("model", ""), labels.get("arm", ""))
            if sample.name == ARM_INFO and sample.value == 1:
                scrape.arm_info.append(
                    {k: labels.get(k, "") for k in ("model", "arm", "kind", "device_group")}
                )
            elif sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in HISTOGRAMS:
                name = sample.name[: -len("_bucket")]
                per_key = buckets.setdefault(name, {}).setdefault(key, {})
                per_key[float(labels["le"])] = sample.value
            elif sample.name in (RUNNING, ITERATIONS, KERNELS_BUILDING):
                scrape.values.setdefault(sample.name, {})[key] = sample.value
    for name, per_arm in buckets.items():
        scrape.histograms[name] = {k: Histogram.from_cumulative(b) for k, b in per_arm.items()}
    return scrape


def metrics_url(url: str) -> str:
    """`http://host:port[/v1]` -> `http://host:port/metrics`."""
    root = url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    return root if root.endswith("/metrics") else f"{root}/metrics"


def scrape(client: httpx.Client, url: str) -> Scrape:
    """GET the server's /metrics; raises httpx errors and ValueError for a bad answer."""
    response = client.get(metrics_url(url))
    if response.status_code != 200:
        raise ValueError(f"{metrics_url(url)} answered HTTP {response.status_code}")
    return parse_exposition(response.text)


@dataclass
class PrometheusAPI:
    """The few queries `carousel ab report --prometheus URL` needs (the HTTP API, v1)."""

    client: httpx.Client
    base: str

    def _get(self, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.client.get(f"{self.base.rstrip('/')}/api/v1/{path}", params=params)
        payload = response.json() if response.status_code in (200, 400, 422) else None
        if not isinstance(payload, dict) or payload.get("status") != "success":
            error = payload.get("error") if isinstance(payload, dict) else None
            raise ValueError(f"Prometheus {path} failed: {error or response.status_code}")
        result = payload["data"]["result"]
        return result if isinstance(result, list) else []

    def histograms(self, model: str, window_s: float, at: float) -> Scrape:
        """Each histogram's `increase()` over the window ending at `at`, per arm."""
        scrape = Scrape(at)
        for name in HISTOGRAMS:
            query = f'increase({name}_bucket{{model="{model}"}}[{math.ceil(window_s)}s])'
            per_key: dict[Key, dict[float, float]] = {}
            for series in self._get("query", {"query": query, "time": at}):
                labels = series["metric"]
                key = (labels.get("model", ""), labels.get("arm", ""))
                per_key.setdefault(key, {})[float(labels["le"])] = float(series["value"][1])
            scrape.histograms[name] = {k: Histogram.from_cumulative(b) for k, b in per_key.items()}
        for series in self._get("query", {"query": ARM_INFO, "time": at}):
            labels = series["metric"]
            if labels.get("model") == model:
                keys = ("model", "arm", "kind", "device_group")
                scrape.arm_info.append({k: labels.get(k, "") for k in keys})
        return scrape

    def running(self, model: str, window_s: float, at: float) -> dict[str, list[float]]:
        """Per arm, `carousel_num_requests_running` sampled over the window (one step grid)."""
        step = max(1.0, window_s / 1000)
        params = {
            "query": f'{RUNNING}{{model="{model}"}}',
            "start": at - window_s,
            "end": at,
            "step": step,
        }
        grid = np.arange(at - window_s, at + step / 2, step)
        out: dict[str, list[float]] = {}
        for series in self._get("query_range", params):
            values = dict((round(float(t), 3), float(v)) for t, v in series["values"])
            arm = series["metric"].get("arm", "")
            out[arm] = [values.get(round(float(t), 3), 0.0) for t in grid]
        return out


def building_in(scrapes: Iterable[Scrape], model: str, arms: Iterable[str]) -> list[str]:
    """The arms among `arms` of `model` that any of `scrapes` shows building their CPU kernels
    in the background (their numbers then mix torch's ops and the kernels')."""
    wanted = set(arms)
    seen = {
        arm
        for scrape in scrapes
        for (m, arm), value in scrape.values.get(KERNELS_BUILDING, {}).items()
        if m == model and arm in wanted and value > 0
    }
    return sorted(seen)
