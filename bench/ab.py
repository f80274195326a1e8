"""`carousel ab report`: the verdict of a live A/B split, and whether it is confounded.

Sources, in order of preference:

- `--record FILE`: the traffic record (per request: arm, TTFT, e2e, tokens, status), resampled
  over requests like the bench (independently per arm: the arms served different requests).
  `--since D` keeps the records of the last D. No ITL (the record has none).
- `--prometheus URL --since D`: `increase()` of the per-arm histograms over the last D, and
  `carousel_num_requests_running` over it.
- `--window S`: two scrapes of the server's /metrics S seconds apart (the command waits), and
  the running gauges polled in between.
- neither: one scrape; the numbers cover everything since the server started.

Refused (exit 1, with the reason) when a scrape shows a compared arm's CPU kernels still
building in the background (`carousel_cpu_kernels_building`): its numbers would mix two paths
(bench/kernels_wait.py). A traffic record or Prometheus range holds no such series yet, so
those sources are not checked.

From histograms, quantiles are interpolated inside buckets (Prometheus' histogram_quantile)
and their intervals come from resampling the bucket counts (multinomial); TPOT has no
histogram, and goodput only has its TTFT part.

Load (bench/ab_load.py): arms compared at unequal loads per engine (an identical pair of
engines at 10/90) are reported as confounded by load, naming the fix.

Unit: the record's verdict resamples users (a split assigns by `user`, so a user's requests
move together); a request without `user` is its own unit.

Confounding: arms with one `device_group` in `carousel_arm_info` (local arms of one process:
one device thread) share the device; arms that both export `carousel_num_requests_running`
in one scrape are local arms of one process, so they share it too. They are *confounded* when
both had requests running during more than `CONFOUNDED_OVERLAP` of the time either had.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.ab_load import engines_of, load_entry
from bench.client import RequestResult
from bench.kernels_wait import KernelsNotReady
from bench.metrics import Slo, parse_slo
from bench.prom import (
    E2E,
    ITERATIONS,
    ITL,
    RUNNING,
    TTFT,
    Histogram,
    PrometheusAPI,
    Scrape,
    building_in,
    parse_duration,
    scrape,
)
from bench.replay import Recorded, load_records
from bench.stats import (
    histogram_quantile,
    histogram_share_below,
    resample_histogram,
)
from bench.verdict import (
    DEFAULT_RESAMPLES,
    METRICS_BY_KEY,
    Estimate,
    MetricSpec,
    compare_estimates,
    compare_runs,
    run_sample,
)

EXIT_OK, EXIT_NO_DATA, EXIT_USAGE = 0, 1, 2
#: both arms busy during more than this share of the time either was: confounded
CONFOUNDED_OVERLAP = 0.05
POLL_S = 0.5
BASELINE_ARM = "static"
HISTOGRAM_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft_p50", TTFT),
    ("ttft_p99", TTFT),
    ("itl_p99", ITL),
    ("e2e_p50", E2E),
    ("e2e_p99", E2E),
)
RECORD_METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50", "e2e_p99", "goodput")
DESCRIPTION = (
    "The verdict of a live A/B split: each arm against the first, per metric, with 95% "
    "intervals, from the server's per-arm histograms (or its traffic record), and whether the "
    "arms shared one device under load, which confounds the comparison."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `ab` (with its `report` subcommand) to the gateway CLI."""
    ab = subparsers.add_parser("ab", help="A/B verdicts from a live deployment")
    sub = ab.add_subparsers(dest="ab_command", required=True)
    report = sub.add_parser("report", help="the verdict of a live split", description=DESCRIPTION)
    add_report_arguments(report)
    report.set_defaults(func=run_report)


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `carousel ab report` (docs/ab-testing.md)."""
    parser.add_argument("--url", help="the Carousel server (its /metrics, /v1 optional)")
    parser.add_argument("--model", default=None, help="the served model (default: the only one)")
    parser.add_argument(
        "--arm", action="append", default=[], help="arms to compare, the first is the baseline"
    )
    parser.add_argument(
        "--since",
        type=_arg(parse_duration),
        default=None,
        metavar="D",
        help="only the last D (e.g. 1h): needs --prometheus or --record",
    )
    parser.add_argument("--prometheus", metavar="URL", help="a Prometheus server scraping it")
    parser.add_argument(
        "--window",
        type=_arg(parse_duration),
        default=None,
        metavar="D",
        help="measure the next D: scrape, wait D polling the running gauges, scrape again",
    )
    parser.add_argument(
        "--record", nargs="+", metavar="FILE", help="the traffic record: per-request verdict"
    )
    parser.add_argument("--slo", type=_arg(parse_slo), default=None, metavar="ttft=2s,tpot=200ms")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument("--out", type=Path, default=None, help="write ab_report.json/.md here")


# -- device sharing ----------------------------------------------------------------------------


def sample_overlap(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Share of samples where both arms ran requests, among those where either did."""
    either = sum(x > 0 or y > 0 for x, y in zip(a, b, strict=False))
    both = sum(x > 0 and y > 0 for x, y in zip(a, b, strict=False))
    return both / either if either else None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def interval_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float | None:
    """Time both arms had a request in flight / time either had one."""
    ua, ub = _union(a), _union(b)
    either = sum(e - s for s, e in _union(ua + ub))
    both, j = 0.0, 0
    for start, end in ua:
        while j < len(ub) and ub[j][1] <= start:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < end:
            both += max(0.0, min(end, ub[k][1]) - max(start, ub[k][0]))
            k += 1
    return both / either if either > 0 else None


def device_of(
    info: list[dict[str, str]], local_arms: set[str], model: str, base: str, arm: str
) -> tuple[bool | None, str | None]:
    """(whether `base` and `arm` share a device, the group or the reason we think so)."""
    groups = {i["arm"]: i["device_group"] for i in info if i["model"] == model}
    if base in groups and arm in groups:
        shared = groups[base] == groups[arm]
        return shared, groups[base] if shared else f"{groups[base]} and {groups[arm]}"
    if base in local_arms and arm in local_arms:
        return True, "the server's process: both are local arms, they export running gauges"
    return None, None


def confounding(
    base: str, arm: str, shared: bool | None, group: str | None, overlap: float | None,
    both_served: bool,
) -> dict[str, Any]:  # fmt: skip
    """The device entry of one compared pair: `confounded` True, False or None (unknown)."""
    entry: dict[str, Any] = {
        "baseline": base,
        "arm": arm,
        "shared_device": shared,
        "device_group": group,
        "busy_overlap": overlap,
        "confounded": None,
    }
    if shared is None:
        entry["text"] = (
            f"unknown whether {base} and {arm} share a device: the server exports no "
            "carousel_arm_info for them"
        )
    elif not shared:
        entry["confounded"] = False
        entry["text"] = f"{base} and {arm} run on separate devices ({group}): not confounded"
    elif overlap is None and both_served:
        entry["text"] = (
            f"possibly confounded: {base} and {arm} share one device ({group}) and both served "
            "traffic, but whether at the same time is unknown (use --window, --prometheus or "
            "--record)"
        )
    elif overlap is not None and overlap > CONFOUNDED_OVERLAP:
        entry["confounded"] = True
        entry["text"] = (
            f"CONFOUNDED: {base} and {arm} share one device ({group}) and both had requests "
            f"running during {overlap:.0%} of the time either did, so each arm's latency "
            "includes the other's load. For a fair comparison, record the traffic and replay it "
            "to each arm in turn: carousel bench --replay FILE --arm ... (docs/bench.md)"
        )
    else:
        entry["confounded"] = False
        busy = "" if overlap is None else f" (both busy {overlap:.0%} of the time)"
        entry["text"] = (
            f"{base} and {arm} share one device ({group}) but were rarely busy at the same "
            f"time{busy}: not confounded by the shared device"
        )
    return entry


# -- verdicts from histograms and from the record -----------------------------------------------


def _histogram_estimate(
    hist: Histogram | None, spec: MetricSpec, rng: np.random.Generator, num_resamples: int
) -> Estimate:
    if hist is None or hist.total == 0:
        return Estimate(None, None, 0)
    draws = resample_histogram(rng, hist.counts, num_resamples)
    value = float(histogram_quantile(hist.bounds, hist.counts, spec.q)) * 1000
    return Estimate(value, histogram_quantile(hist.bounds, draws, spec.q) * 1000, hist.total)


def _share_estimate(
    hist: Histogram | None, x_s: float, rng: np.random.Generator, num_resamples: int
) -> Estimate:
    if hist is None or hist.total == 0:
        return Estimate(None, None, 0)
    draws = resample_histogram(rng, hist.counts, num_resamples)
    value = float(histogram_share_below(hist.bounds, hist.counts, x_s))
    return Estimate(value, histogram_share_below(hist.bounds, draws, x_s), hist.total)


def histogram_verdict(
    window: Scrape, model: str, base: str, arm: str, slo: Slo, rng: np.random.Generator,
    num_resamples: int,
) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """Entries from the per-arm histograms, and notes on what they cannot say."""
    method = f"multinomial bootstrap over histogram buckets ({num_resamples} resamples)"
    entries = []
    for key, family in HISTOGRAM_METRICS:
        spec = METRICS_BY_KEY[key]
        hists = window.histograms.get(family, {})
        b = _histogram_estimate(hists.get((model, base)), spec, rng, num_resamples)
        a = _histogram_estimate(hists.get((model, arm)), spec, rng, num_resamples)
        entry = compare_estimates(spec, base, b, arm, a, method)
        if family == ITL and entry["note"] is None:
            entry["note"] = "gaps of one request move together: this interval is too narrow"
        entries.append(entry)
    notes = [
        "p50 TPOT: not compared from /metrics (there is no TPOT histogram; use --record)",
        "output tok/s: not compared live (it follows each arm's share of the traffic)",
    ]
    if slo.ttft_ms is not None and slo.tpot_ms is None:
        ttft = window.histograms.get(TTFT, {})
        spec = METRICS_BY_KEY["goodput"]
        b = _share_estimate(ttft.get((model, base)), slo.ttft_ms / 1000, rng, num_resamples)
        a = _share_estimate(ttft.get((model, arm)), slo.ttft_ms / 1000, rng, num_resamples)
        entry = compare_estimates(spec, base, b, arm, a, method)
        entry["note"] = "share of requests with a first token that met the TTFT objective"
        entries.append(entry)
    elif slo.active:
        notes.append("goodput: /metrics has no TPOT, so only --record can check a TPOT objective")
    return entries, notes


def record_results(records: list[Recorded]) -> list[RequestResult]:
    """The records as bench results (status 499, a client that left, counts as neither)."""
    results = []
    for i, rec in enumerate(records):
        o = rec.outcome
        tokens = o.get("completion_tokens")
        result = RequestResult(i, tokens if isinstance(tokens, int) else 0)
        if o.get("status") == 200:
            result.success = True
            result.ttft, result.latency = o.get("ttft_s"), o.get("e2e_s")
            result.usage_output_tokens = tokens if isinstance(tokens, int) else None
        elif o.get("status") != 499:
            result.error = f"HTTP {o.get('status')}"
        results.append(result)
    return results


def record_users(records: list[Recorded]) -> np.ndarray:
    """Each record's unit: its `user` (a split assigns by it, so a user's requests share an
    arm and move together), else the request itself."""
    return np.asarray(
        [
            f"user:{user}" if isinstance(user := rec.body.get("user"), str) and user else f"#{i}"
            for i, rec in enumerate(records)
        ]
    )


def record_verdict(
    by_arm: dict[str, list[Recorded]], base: str, arm: str, slo: Slo, rng: np.random.Generator,
    num_resamples: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Entries from the traffic record: a bootstrap over each arm's own users (the unit a
    split randomises; a request without `user` is its own)."""
    samples = []
    for name in (base, arm):
        results = record_results(by_arm.get(name, []))
        samples.append(run_sample(results, len(results), None, slo))
    metrics = [METRICS_BY_KEY[k] for k in RECORD_METRICS]
    clusters = (record_users(by_arm.get(base, [])), record_users(by_arm.get(arm, [])))
    return compare_runs(
        base, [samples[0]], arm, [samples[1]], slo_active=slo.active, rng=rng,
        num_resamples=num_resamples, paired=False, metrics=metrics, simultaneous=True,
        clusters=clusters,
    )  # fmt: skip


def record_intervals(records: list[Recorded]) -> list[tuple[float, float]]:
    return [
        (r.wall_time, r.wall_time + float(r.outcome["e2e_s"]))
        for r in records
        if isinstance(r.outcome.get("e2e_s"), int | float)
    ]


# -- the command -------------------------------------------------------------------------------


def _usage(message: str) -> int:
    print(f"carousel ab report: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_report(args: argparse.Namespace) -> int:
    """Print the verdict (and write it with --out); 1 when there is nothing to compare."""
    if not args.url and not args.record:
        return _usage("give --url (the server) and/or --record (its traffic record)")
    if args.since is not None and not (args.prometheus or args.record):
        return _usage(
            "--since needs --prometheus or --record: one /metrics scrape only holds totals "
            "since the server started (--window D measures the next D instead)"
        )
    if args.prometheus and args.since is None:
        return _usage("--prometheus needs --since (the window to query)")
    try:
        report = build_ab_report(args)
    except KernelsNotReady as exc:
        print(f"carousel ab report: refused: {exc}", file=sys.stderr)
        return EXIT_NO_DATA
    except (httpx.HTTPError, OSError, ValueError) as exc:
        print(f"carousel ab report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NO_DATA if isinstance(exc, httpx.HTTPError) else EXIT_USAGE
    print(render_text(report))
    if args.out is not None:
        write_ab_report(args.out, report)
        print(f"report: {args.out / 'ab_report.json'} and {args.out / 'ab_report.md'}")
    return EXIT_OK if report["comparison"] else EXIT_NO_DATA


def _poll_window(client: httpx.Client, url: str, window_s: float) -> tuple[Scrape, list[Scrape]]:
    """Two scrapes `window_s` apart, polling in between; the window counts down on stderr."""
    from tqdm import tqdm

    first = scrape(client, url)
    polls = [first]
    start = time.monotonic()
    deadline = start + window_s
    bar_format = "measuring {desc}: {n:.0f}/{total:.0f} s [{elapsed}<{remaining} left]"
    with tqdm(total=window_s, desc=url, bar_format=bar_format, file=sys.stderr) as bar:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(POLL_S, left))
            polls.append(scrape(client, url))
            bar.update(min(time.monotonic(), deadline) - start - bar.n)
    return polls[-1].since(first), polls


def build_ab_report(args: argparse.Namespace) -> dict[str, Any]:
    """Gather the data, decide the arms, compute the verdict and the device entries."""
    slo = args.slo or Slo()
    rng = np.random.default_rng([args.seed, 17])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    current: Scrape | None = None
    window: Scrape | None = None
    running: dict[str, list[float]] = {}
    scrapes: list[Scrape] = []  # every /metrics read: an arm building in one refuses them all
    now = time.time()
    with httpx.Client(timeout=30, headers=headers, trust_env=False) as client:
        if args.url:
            current = scrape(client, args.url)
            scrapes.append(current)
        if args.url and args.window is not None and not args.record:
            window, polls = _poll_window(client, args.url, args.window)
            current = polls[-1]
            scrapes += polls
            for poll in polls:
                for (_, arm_name), value in poll.values.get(RUNNING, {}).items():
                    running.setdefault(arm_name, []).append(value)
        model = _model(args.model, current, args.record)
        if args.prometheus and not args.record:
            api = PrometheusAPI(client, args.prometheus)
            window = api.histograms(model, args.since, now)
            running = api.running(model, args.since, now)
    records: dict[str, list[Recorded]] = {}
    if args.record:
        loaded, _ = load_records(args.record)
        cutoff = now - args.since if args.since is not None else -np.inf
        for rec in loaded:
            if rec.wall_time >= cutoff and (not model or rec.model in (model, None)):
                records.setdefault(str(rec.arm), []).append(rec)
    info = current.arm_info if current is not None else []
    if window is not None and not info:
        info = window.arm_info
    arms = list(dict.fromkeys(args.arm)) or _arms(current, window, records, model)
    if len(arms) < 2:
        raise ValueError(f"need two arms to compare, found {arms or 'none'}")
    unready = building_in(scrapes, model, arms)
    if unready:
        raise KernelsNotReady(
            f"the CPU kernels of {', '.join(unready)} were building in the background while "
            "measured: their numbers mix torch's ops and the kernels (about 2x apart a token); "
            "measure once /health names them `carousel`"
        )
    local = set((current.values.get(RUNNING, {}) if current else {}).keys())
    local_arms = {a for m, a in local if m == model}
    source, window_text = _describe(args)
    base = arms[0]
    comparison: list[dict[str, Any]] = []
    device: list[dict[str, Any]] = []
    load: list[dict[str, Any]] = []
    notes: list[str] = []
    for arm in arms[1:]:
        if args.record:
            rows = record_verdict(records, base, arm, slo, rng, args.resamples)
            overlap = interval_overlap(
                record_intervals(records.get(base, [])), record_intervals(records.get(arm, []))
            )
            served = bool(records.get(base)) and bool(records.get(arm))
        else:
            data = window if window is not None else current
            assert data is not None
            rows, extra = histogram_verdict(data, model, base, arm, slo, rng, args.resamples)
            notes += [n for n in extra if n not in notes]
            overlap = (
                sample_overlap(running.get(base, []), running.get(arm, [])) if running else None
            )
            served = _served(data, model, base) and _served(data, model, arm)
        comparison += rows
        shared, group = device_of(info, local_arms, model, base, arm)
        device.append(confounding(base, arm, shared, group, overlap, served))
        arm_requests = {
            a: _arm_entry(a, info, model, window or current, records)["requests"]
            for a in (base, arm)
        }
        engines = {a: engines_of(info, model, a) for a in (base, arm)}
        load.append(load_entry(base, arm, arm_requests, engines))
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "url": args.url,
        "model": model,
        "source": source,
        "window": window_text,
        "baseline": base,
        "arms": [_arm_entry(a, info, model, window or current, records) for a in arms],
        "device": device,
        "load": load,
        "comparison": comparison,
        "notes": notes,
    }


def _model(requested: str | None, current: Scrape | None, record: Any) -> str:
    if requested:
        return requested
    models = [m for m in (current.models() if current else []) if m]
    if len(models) == 1:
        return models[0]
    if not models and record:
        return ""
    raise ValueError(f"name the model with --model (the server serves {models or 'none'})")


def _arms(
    current: Scrape | None, window: Scrape | None, records: dict[str, list[Recorded]], model: str
) -> list[str]:
    if records:
        return baseline_first(sorted(a for a in records if a != "None"))
    names: list[str] = []
    for data in (current, window):
        if data is not None:
            names += data.arms(model)
    return baseline_first(list(dict.fromkeys(names)))


def baseline_first(arms: list[str]) -> list[str]:
    """`static` (request-level batching, the baseline every policy is measured against)
    first when it is one of the arms; the others keep their order."""
    return sorted(arms, key=lambda arm: arm != BASELINE_ARM)


def _served(data: Scrape, model: str, arm: str) -> bool:
    iterations = data.values.get(ITERATIONS, {}).get((model, arm), 0.0)
    e2e = data.histograms.get(E2E, {}).get((model, arm))
    return iterations > 0 or (e2e is not None and e2e.total > 0)


def _describe(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.record:
        files = ", ".join(args.record)
        since = {"kind": "since", "seconds": args.since} if args.since else {"kind": "all"}
        return f"traffic record {files}", since
    if args.prometheus:
        return f"Prometheus {args.prometheus}", {"kind": "since", "seconds": args.since}
    if args.window is not None:
        return f"{args.url}/metrics, two scrapes", {"kind": "window", "seconds": args.window}
    return f"{args.url}/metrics", {"kind": "since_start", "seconds": None}


def _arm_entry(
    arm: str, info: list[dict[str, str]], model: str, data: Scrape | None,
    records: dict[str, list[Recorded]],
) -> dict[str, Any]:  # fmt: skip
    found = next((i for i in info if i["arm"] == arm and i["model"] == model), {})
    e2e = data.histograms.get(E2E, {}).get((model, arm)) if data is not None else None
    requests = len(records[arm]) if arm in records else (e2e.total if e2e is not None else 0)
    return {
        "arm": arm,
        "kind": found.get("kind"),
        "device_group": found.get("device_group"),
        "requests": requests,
    }


def _window_sentence(window: dict[str, Any]) -> str:
    kind = window["kind"]
    if kind == "since_start":
        return "since the server started (one scrape: its counters are cumulative)"
    if kind == "window":
        return f"over the {window['seconds']:g} s between two scrapes"
    if kind == "since":
        return f"over the last {window['seconds']:g} s"
    return "over the whole record"


def render_text(report: dict[str, Any]) -> str:
    """What the command prints; report.md holds the same lines."""
    arms = ", ".join(
        f"{a['arm']} ({a['requests']} requests{', ' + a['kind'] if a['kind'] else ''})"
        for a in report["arms"]
    )
    lines = [
        f"carousel ab report: {report['model'] or 'all models'}, from {report['source']}, "
        f"{_window_sentence(report['window'])}",
        f"arms: {arms}; baseline {report['baseline']}",
        "",
    ]
    lines += [f"device: {d['text']}" for d in report["device"]]
    lines += [f"load: {d['text']}" for d in report.get("load", [])]
    for arm in dict.fromkeys(e["arm"] for e in report["comparison"]):
        lines += ["", f"{arm} against {report['baseline']}:"]
        for e in (e for e in report["comparison"] if e["arm"] == arm):
            note = f" [{e['note']}]" if e["note"] and e["significant"] is not None else ""
            lines.append(f"  - {e['sentence']}{note}")
    if report["notes"]:
        lines += ["", *(f"note: {n}" for n in report["notes"])]
    return "\n".join(lines)


def write_ab_report(out: Path, report: dict[str, Any]) -> None:
    """ab_report.json, ab_report.md and comparison.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    md = ["# carousel ab report", "", "```", render_text(report), "```", ""]
    if report["comparison"]:
        from bench.plots import plot_comparison

        plot_comparison(report["comparison"], out / "comparison.png", report["model"] or "")
        md += ["![each metric's difference, 95% interval](comparison.png)", ""]
    (out / "ab_report.md").write_text("\n".join(md), encoding="utf-8")
