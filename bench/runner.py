"""Run the workload against every arm (and every rate of a sweep), one run at a time.

Runs go rate by rate and, within a rate, arm by arm, so the arms of one rate are measured back
to back under the same conditions. With `repeats` > 1, each rate runs every arm `repeats` times,
repeat r on its own workload (seed + r; a replay's record every time), the arms' order reversed
on odd repeats (A B, B A, A B, ...) so a slow drift of the machine favours no arm.

Before each run, `warmups` requests of the workload go to the arm unmeasured (all at once), so
the first arm does not alone pay for cold caches and new connections. After each run the arm's
iteration trace is fetched. The first Ctrl-C (SIGINT) stops cleanly: the current run's
in-flight requests are cancelled, no further run starts, and what was measured is still
reported; a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.client import ClientConfig, RequestResult, RunOutcome, run_requests
from bench.metrics import Slo, compute_metrics
from bench.trace import ArmTrace, fetch_trace, server_root, truncated
from bench.workload import LengthDist, RequestSpec, arrival_offsets, num_arrivals, spread_offsets

DEFAULT_ARM = "default"


@dataclass(frozen=True)
class BenchConfig:
    """Everything one `carousel bench` invocation needs, validated."""

    client: ClientConfig
    arms: list[str | None]  # None: send no arm header
    num_requests: int
    rates: list[float]
    burstiness: float
    input_len: LengthDist
    output_len: LengthDist
    dataset: str | None
    seed: int
    slo: Slo
    out_dir: Path
    url: str
    progress: bool = True
    fetch_trace: bool = True
    warmups: int = 0
    repeats: int = 1
    num_resamples: int = 2000
    equivalence_margin: float = 0.05
    #: a replay's send times (seconds after the start), instead of arrivals drawn at a rate
    offsets: list[float] | None = None
    replay: dict[str, Any] | None = None  # what report.json says about the replay
    shared_prefix_len: int = 0
    multi_turn: int = 1
    users: list[tuple[str, float]] | None = None  # `--users`
    deadlines: list[tuple[str, float]] | None = None  # `--deadline-mix`
    verdict_user: str | None = None  # `--verdict-user`
    #: arms whose probe was refused with ignore_eos (bench/probe.py): sent without it
    ignore_eos_refused: tuple[str | None, ...] = ()

    def client_for(self, arm: str | None) -> ClientConfig:
        """The client settings of one arm: without ignore_eos where the arm refuses it."""
        if arm in self.ignore_eos_refused:
            return dataclasses.replace(self.client, ignore_eos=False)
        return self.client


@dataclass
class RunRecord:
    """One arm at one rate: its requests, metrics and engine trace."""

    arm: str
    arm_header: str | None
    rate: float
    outcome: RunOutcome
    metrics: dict[str, Any]
    trace: ArmTrace = field(default_factory=ArmTrace)
    repeat: int = 0
    num_requests: int = 0  # the workload's size (requests never sent are missing from results)

    @property
    def results(self) -> list[RequestResult]:
        return self.outcome.results


@dataclass
class BenchResult:
    """All runs of an invocation, in the order they ran."""

    runs: list[RunRecord]
    interrupted: bool
    #: each local arm's CPU-kernel path before and after the runs, and what switched
    #: between them (bench/kernels_wait.py); empty where the server names none
    kernels: dict[str, Any] = field(default_factory=dict)


def arm_name(arm: str | None) -> str:
    """The name an arm has in the report: its header value, or "default" without one."""
    return arm if arm is not None else DEFAULT_ARM


def rate_label(rate: float) -> str:
    """`4.0` -> `4`, `0.5` -> `0.5`, `inf` -> `inf`."""
    if math.isinf(rate):
        return "inf"
    return f"{rate:g}"


async def run_bench(cfg: BenchConfig, workloads: Sequence[list[RequestSpec]]) -> BenchResult:
    """Run every (rate, repeat, arm) in turn; `workloads[r]` is repeat r's (module docstring)."""
    stop = asyncio.Event()
    _install_sigint(stop)
    runs: list[RunRecord] = []
    try:
        for rate in cfg.rates:
            for repeat in range(cfg.repeats):
                specs = workloads[repeat % len(workloads)]
                if cfg.offsets is not None:
                    offsets = cfg.offsets
                else:
                    arrivals = arrival_offsets(
                        num_arrivals(specs), rate, cfg.burstiness, cfg.seed + repeat
                    )
                    offsets = spread_offsets(specs, arrivals)
                arms = cfg.arms if repeat % 2 == 0 else cfg.arms[::-1]
                for arm in arms:
                    record = await _run_one(cfg, specs, offsets, arm, rate, stop)
                    record.repeat = repeat
                    runs.append(record)
                    if stop.is_set():
                        return BenchResult(runs, interrupted=True)
    finally:
        _remove_sigint()
    return BenchResult(runs, interrupted=False)


async def _run_one(
    cfg: BenchConfig,
    specs: list[RequestSpec],
    offsets: list[float],
    arm: str | None,
    rate: float,
    stop: asyncio.Event,
) -> RunRecord:
    name = arm_name(arm)
    client = cfg.client_for(arm)
    if cfg.warmups:
        firsts = [spec for spec in specs if spec.turn == 1]
        warmup = [firsts[i % len(firsts)] for i in range(cfg.warmups)]
        await run_requests(client, warmup, [0.0] * len(warmup), arm, stop)
    bar = tqdm(
        total=len(specs),
        desc=f"{name} @ {rate_label(rate)} req/s" + (" (replay)" if cfg.replay else ""),
        unit="req",
        disable=None if cfg.progress else True,
        file=sys.stderr,
    )
    began_cpu = time.process_time()
    try:
        outcome = await run_requests(
            client, specs, offsets, arm, stop, on_done=lambda _: bar.update()
        )
    finally:
        bar.close()
    client_cpu_s = time.process_time() - began_cpu
    metrics = compute_metrics(outcome.results, outcome.duration_s, cfg.slo, client_cpu_s)
    record = RunRecord(name, arm, rate, outcome, metrics, num_requests=len(specs))
    if cfg.fetch_trace:
        root = server_root(cfg.client.api_base)
        window = (outcome.start_wall, outcome.end_wall)
        record.trace = await fetch_trace(root, arm, window, cfg.client.api_key)
        record.trace.truncated = truncated(record.trace, metrics["completed"])
    else:
        record.trace = ArmTrace(note="trace fetching was turned off (--no-trace)")
    return record


def _install_sigint(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def first_sigint() -> None:
        print("\ninterrupted: stopping, the report will hold what was measured", file=sys.stderr)
        stop.set()
        _remove_sigint()  # a second Ctrl-C raises KeyboardInterrupt as usual

    # Not the main thread, or a platform without loop signal handlers: no clean Ctrl-C.
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, first_sigint)


def _remove_sigint() -> None:
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
