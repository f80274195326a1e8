"""Write a bench's results: report.json, report.md, requests.jsonl and the PNG plots.

report.json (schema_version 1; `comparison` became the verdict, the ratios moved to `ratios`)::

    {
      "schema_version": 1, "created": ISO-8601 UTC, "interrupted": bool,
      "config": {"url", "model", "endpoint", "arms", "num_requests", "rates", "burstiness",
                 "input_len", "output_len", "dataset", "seed", "max_concurrency",
                 "slo_ttft_ms", "slo_tpot_ms", "ignore_eos", "temperature", "ignore_eos_refused",
                 "timeout_s", "warmups",
                 "repeats", "resamples", "equivalence_margin",
                 "replay": null | {"files", "time_scale", ...},
                 "shared_prefix_len", "multi_turn"},
      "workload": {"num_requests", "mean_target_input_len", "mean_max_tokens"},
      "runs": [{"arm", "rate", "repeat", "start_time", "end_time", "interrupted",
                "metrics": {see metrics.compute_metrics}, "mean_prompt_tokens",
                "errors": {message: count},
                "trace": {"available", "note", "num_iterations", "max_num_seqs",
                          "mean_batch_size", "seat_occupancy", "num_preempted",
                          "truncated", and where the arm verified drafts
                          "num_verified_steps", "num_drafts", "num_draft_tokens",
                          "num_accepted_tokens", "mean_acceptance_length"},
                "prefix_cache": {"hit_rate", "cached_tokens", "prompt_tokens",
                                 "ttft_ms_first_turns", "ttft_ms_later_turns"}}],
      "comparison": [{"rate", "metric", "label", "unit", "baseline", "arm",
                      "baseline_value", "arm_value", "diff", "ci95", "diff_abs", "ci95_abs",
                      "significant", "better", "equivalence_margin", "ci90", "equivalent",
                      "outcome", "same_schedule", "schedule_similarity", "n_baseline",
                      "n_arm", "method", "note", "sentence"}],
      "ratios": [{"rate", "baseline", "arm", "<metric>_ratio", ...}],
      "files": {"report_md", "requests", "plots": [file names], "verdict_plots": [file names]},
      "kernels": {} | {"before": {"model/arm": "torch" | "building" | "carousel"},
                       "after": {...}, "switched": ["model/arm: before -> after"]},
      "notes": [str]
    }

`kernels`: each local arm's CPU-kernel path as the server's /health named it before and after
the runs (bench/kernels_wait.py); a non-empty `switched` makes the report invalid (a note).

`comparison` is the verdict (bench/verdict.py: `diff` is relative, arm / baseline - 1, and
`diff_abs` absolute, both with 95% bootstrap intervals). `ratios` are the plain arm / baseline
ratios of the first repeat's metrics (what `comparison` held before the verdict).

Rates are numbers, or the string "inf" for a burst (a replay's rate is its mean offered
rate). Latencies are in milliseconds, throughputs per second. requests.jsonl has one line per
request sent, with its raw timings.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.answers import agreement_sentence, answer_agreement
from bench.comparison import bench_comparison, verdict_markdown
from bench.metrics import compute_metrics, error_counts, prefix_cache_summary, tpot
from bench.runner import BenchConfig, BenchResult, RunRecord, arm_name, rate_label
from bench.trace import trace_summary
from bench.workload import RequestSpec

SCHEMA_VERSION = 1
# (key in report.json, metrics path, higher is better)
COMPARED: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("request_throughput", ("request_throughput",), True),
    ("output_throughput", ("output_throughput",), True),
    ("goodput", ("goodput",), True),
    ("p50_ttft", ("ttft_ms", "p50"), False),
    ("p99_ttft", ("ttft_ms", "p99"), False),
    ("p99_tpot", ("tpot_ms", "p99"), False),
    ("p50_e2e_latency", ("e2e_latency_ms", "p50"), False),
    ("p99_e2e_latency", ("e2e_latency_ms", "p99"), False),
)


def json_rate(rate: float) -> float | str:
    """Rates as JSON: numbers, or "inf"."""
    return "inf" if math.isinf(rate) else rate


def write_report(cfg: BenchConfig, specs: list[RequestSpec], result: BenchResult) -> Path:
    """Write every output file into `cfg.out_dir`; returns the report.json path."""
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    _write_requests(out / "requests.jsonl", result.runs)
    notes: list[str] = []
    comparison = _comparison(cfg, result)
    plots = _draw_plots(out, cfg, result.runs, notes)
    verdict_plots = _draw_verdict_plots(out, cfg, comparison)
    report = build_report(cfg, specs, result, plots, notes, comparison, verdict_plots)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    return out / "report.json"


def _comparison(cfg: BenchConfig, result: BenchResult) -> list[dict[str, Any]]:
    """The verdict's entries for report.json, each `rate` as JSON (numbers, or "inf")."""
    comparison = bench_comparison(
        result,
        cfg.arms,
        cfg.slo,
        cfg.num_resamples,
        cfg.seed,
        cfg.verdict_user,
        margin=cfg.equivalence_margin,
    )
    for entry in comparison:
        entry["rate"] = json_rate(entry["rate"])
    return comparison


def _identical_answers(
    cfg: BenchConfig, specs: list[RequestSpec], result: BenchResult
) -> list[dict[str, Any]]:
    """Per rate and arm, the share of greedy answers equal to the baseline's (bench/answers.py)."""
    entries = answer_agreement(result, cfg.arms, specs, cfg.multi_turn > 1, cfg.client.temperature)
    return [
        {**entry, "rate": json_rate(entry["rate"]), "sentence": agreement_sentence(entry)}
        for entry in entries
    ]


def build_report(
    cfg: BenchConfig,
    specs: list[RequestSpec],
    result: BenchResult,
    plots: list[str],
    notes: list[str],
    comparison: list[dict[str, Any]] | None = None,
    verdict_plots: list[str] | None = None,
) -> dict[str, Any]:
    """The report.json document (see the module docstring)."""
    targets = [s.target_input_len for s in specs if s.target_input_len is not None]
    runs = [_run_entry(run) for run in result.runs]
    notes = list(notes)
    if comparison is None:
        comparison = _comparison(cfg, result)
    if cfg.replay:
        notes.append(
            "replay: a run's rate is the record's mean offered rate; requests went out at "
            "their recorded offsets"
        )
        notes += [f"replay skipped {n} records: {why}" for why, n in cfg.replay["skipped"].items()]
    if len(cfg.arms) > 1 and not cfg.slo.active:
        notes.append("no goodput in the verdict: give --slo ttft=...,tpot=... to compare it")
    if result.kernels.get("switched"):
        notes.append(
            "INVALID: an arm switched from torch's ops to Carousel's CPU kernels during the "
            f"runs, so they mix two paths ({'; '.join(result.kernels['switched'])})"
        )
    if result.interrupted:
        notes.append(
            "interrupted (Ctrl-C): later runs did not start, in-flight requests "
            "were cancelled and are counted as cancelled"
        )
    for run in runs:
        if not run["trace"]["available"]:
            notes.append(
                f"no carousel picture for {run['arm']} @ "
                f"{_rate(run['rate'])} req/s: {run['trace']['note']}"
            )
        elif run["trace"]["truncated"]:
            notes.append(
                f"the carousel picture of {run['arm']} @ {_rate(run['rate'])} req/s starts "
                "mid-run: the server's trace buffer had already dropped the run's first iterations"
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "interrupted": result.interrupted,
        "config": _config_entry(cfg),
        "workload": {
            "num_requests": len(specs),
            "mean_target_input_len": sum(targets) / len(targets) if targets else None,
            "mean_max_tokens": sum(s.max_tokens for s in specs) / len(specs) if specs else None,
        },
        "runs": runs,
        "comparison": comparison,
        "identical_answers": _identical_answers(cfg, specs, result),
        "ratios": _ratios([run for run in runs if run["repeat"] == 0]),
        "files": {
            "report_md": "report.md",
            "requests": "requests.jsonl",
            "plots": plots,
            "verdict_plots": verdict_plots or [],
        },
        "kernels": result.kernels,
        "notes": notes,
    }


def _config_entry(cfg: BenchConfig) -> dict[str, Any]:
    c = cfg.client
    return {
        "url": cfg.url,
        "model": c.model,
        "endpoint": ",".join(cfg.replay["endpoints"]) if cfg.replay else c.endpoint,
        "arms": [a for a in cfg.arms if a is not None],
        "num_requests": cfg.num_requests,
        "rates": [json_rate(r) for r in cfg.rates],
        "burstiness": cfg.burstiness,
        "input_len": None if cfg.dataset or cfg.replay else str(cfg.input_len),
        "output_len": None if cfg.replay else str(cfg.output_len),
        "dataset": cfg.dataset,
        "seed": cfg.seed,
        "max_concurrency": c.max_concurrency,
        "slo_ttft_ms": cfg.slo.ttft_ms,
        "slo_tpot_ms": cfg.slo.tpot_ms,
        "ignore_eos": c.ignore_eos,
        "temperature": c.temperature,
        "ignore_eos_refused": [arm_name(a) for a in cfg.ignore_eos_refused],
        "timeout_s": c.timeout_s,
        "warmups": cfg.warmups,
        "repeats": cfg.repeats,
        "resamples": cfg.num_resamples,
        "equivalence_margin": cfg.equivalence_margin,
        "replay": cfg.replay,
        "shared_prefix_len": cfg.shared_prefix_len,
        "multi_turn": cfg.multi_turn,
    }


def _run_entry(run: RunRecord) -> dict[str, Any]:
    prompts = [r.prompt_tokens for r in run.results if r.success and r.prompt_tokens is not None]
    return {
        "arm": run.arm,
        "rate": json_rate(run.rate),
        "repeat": run.repeat,
        "start_time": run.outcome.start_wall,
        "end_time": run.outcome.end_wall,
        "interrupted": run.outcome.interrupted,
        "metrics": run.metrics,
        "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        "errors": error_counts(run.results),
        "trace": trace_summary(run.trace, run.metrics["completed"]),
        "prefix_cache": prefix_cache_summary(run.results),
    }


def _lookup(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def _ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm against the first arm at the same rate: ratio = arm / baseline."""
    rows: list[dict[str, Any]] = []
    baselines: dict[Any, dict[str, Any]] = {}
    for run in runs:
        base = baselines.setdefault(run["rate"], run)
        if base is run:
            continue
        row: dict[str, Any] = {"rate": run["rate"], "baseline": base["arm"], "arm": run["arm"]}
        for key, path, _ in COMPARED:
            a, b = _lookup(run["metrics"], path), _lookup(base["metrics"], path)
            row[f"{key}_ratio"] = a / b if a is not None and b else None
        rows.append(row)
    return rows


def _write_requests(path: Path, runs: list[RunRecord]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for run in runs:
            for r in run.results:
                per_token = tpot(r)
                line = {
                    "arm": run.arm,
                    "rate": json_rate(run.rate),
                    "repeat": run.repeat,
                    "index": r.index,
                    "success": r.success,
                    "cancelled": r.cancelled,
                    "error": r.error,
                    "send_time_s": r.send_time,
                    "ttft_s": r.ttft,
                    "tpot_s": per_token,
                    "latency_s": r.latency,
                    "itl_s": r.itl,
                    "max_tokens": r.max_tokens,
                    "output_tokens": r.output_tokens,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "turn": r.turn,
                    "target_input_len": r.target_input_len,
                    "user": r.user,
                    "deadline_ms": r.deadline_ms,
                }
                f.write(json.dumps(line) + "\n")


def _draw_verdict_plots(out: Path, cfg: BenchConfig, comparison: list[dict[str, Any]]) -> list[str]:
    from bench import plots

    files: list[str] = []
    for rate in dict.fromkeys(e["rate"] for e in comparison):
        suffix = "" if len(cfg.rates) == 1 else f"_rate{_rate(rate)}"
        entries = [e for e in comparison if e["rate"] == rate]
        title = f"{cfg.client.model} @ {_rate(rate)} req/s"
        files.append(plots.plot_comparison(entries, out / f"comparison{suffix}.png", title).name)
    return files


def _draw_plots(out: Path, cfg: BenchConfig, runs: list[RunRecord], notes: list[str]) -> list[str]:
    from bench import plots  # matplotlib is imported only when drawing

    files: list[str] = []
    rates = list(dict.fromkeys(run.rate for run in runs))
    for rate in rates:
        at_rate = [run for run in runs if run.rate == rate]
        suffix = "" if len(cfg.rates) == 1 else f"_rate{rate_label(rate)}"
        title = f"{cfg.client.model} @ {rate_label(rate)} req/s"
        samples: dict[str, dict[str, list[float]]] = {}
        for run in at_rate:  # repeats pooled
            pool = samples.setdefault(run.arm, {"ttft": [], "e2e": []})
            ok = [r for r in run.results if r.success]
            pool["ttft"] += [r.ttft for r in ok if r.ttft is not None]
            pool["e2e"] += [r.latency for r in ok if r.latency is not None]
        path = plots.plot_latency_cdfs(samples, out / f"latency_cdf{suffix}.png", title)
        files.append(path.name)
        traces = {run.arm: run.trace for run in at_rate if run.repeat == 0}
        picture = plots.plot_carousel(traces, out / f"carousel{suffix}.png", title)
        if picture is not None:
            files.append(picture.name)
    finite = [r for r in rates if math.isfinite(r)]
    if len(finite) > 1:
        points: dict[str, list[dict[str, Any]]] = {}
        for (name, at), pooled in _pooled_metrics(runs, cfg).items():
            points.setdefault(name, []).append({"rate": at, "metrics": pooled})
        files.append(plots.plot_sweep(points, out / "sweep.png").name)
    elif len(cfg.rates) > 1:
        notes.append("no sweep plot: it needs at least two finite rates that ran")
    return files


def _pooled_metrics(runs: list[RunRecord], cfg: BenchConfig) -> dict[tuple[str, float], Any]:
    """Per (arm, rate), the metrics of all its repeats' requests over their summed durations."""
    groups: dict[tuple[str, float], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault((run.arm, run.rate), []).append(run)
    return {
        key: compute_metrics(
            [r for run in group for r in run.results],
            sum(run.outcome.duration_s for run in group),
            cfg.slo,
            _summed(run.metrics.get("client_cpu_s") for run in group),
        )
        for key, group in groups.items()
    }


def _summed(values: Iterable[float | None]) -> float | None:
    """The sum of `values`, None if any is None (a run that measured none)."""
    out = 0.0
    for value in values:
        if value is None:
            return None
        out += value
    return out


def _rate(rate: float | str) -> str:
    """A report.json rate for reading: `4.0` -> `4`, `"inf"` stays."""
    return rate if isinstance(rate, str) else f"{rate:g}"


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the summary tables, the comparison, the pictures and the notes."""
    cfg, runs = report["config"], report["runs"]
    workload = (
        f"dataset `{cfg['dataset']}`"
        if cfg["dataset"]
        else f"input `{cfg['input_len']}`, output `{cfg['output_len']}`"
    )
    replay = cfg.get("replay")
    if replay:
        files = ", ".join(f"`{f}`" for f in replay["files"])
        workload = f"replay of {files} at time scale {replay['time_scale']:g} "
        if "format" in replay:  # a public trace (bench/trace_replay.py)
            exact = "exact" if replay["exact_prompt_lengths"] else "approximate"
            workload += (
                f"({replay['format']} trace, {replay['span_s']:.1f} s from "
                f"{replay['start_s']:g} s into it; {exact} prompt lengths, "
                f"{replay['shared_blocks']} shared prefix blocks)"
            )
        else:
            workload += (
                f"({replay['span_s']:.1f} s; {replay['redacted']} redacted, "
                f"{replay['pinned']} pinned to their recorded output length)"
            )
    slo = f"TTFT <= {_fmt(cfg['slo_ttft_ms'])} ms, TPOT <= {_fmt(cfg['slo_tpot_ms'])} ms"
    lines = [
        f"# carousel bench: `{cfg['model']}`",
        "",
        f"- endpoint: `{cfg['url']}` ({cfg['endpoint']}), created {report['created']}",
        f"- workload: {report['workload']['num_requests']} requests, {workload}, "
        f"rates {', '.join(_rate(r) for r in cfg['rates'])} req/s, "
        f"burstiness {cfg['burstiness']}, seed {cfg['seed']}",
        f"- SLOs: {slo}" if cfg["slo_ttft_ms"] or cfg["slo_tpot_ms"] else "- SLOs: none given",
        "",
    ]
    if report["interrupted"]:
        lines += ["**Interrupted**: the numbers below cover only what ran.", ""]
    lines += _headline(report["comparison"])
    lines += ["## Throughput", ""]
    lines += _table(
        [
            "arm",
            "rate",
            "completed",
            "failed",
            "cancelled",
            "req/s",
            "output tok/s",
            "total tok/s",
            "goodput req/s",
            "prompt tok (mean)",
        ],
        [
            [
                run["arm"],
                _rate(run["rate"]),
                _fmt(m["completed"]),
                _fmt(m["failed"]),
                _fmt(m["cancelled"]),
                _fmt(m["request_throughput"], 2),
                _fmt(m["output_throughput"]),
                _fmt(m["total_token_throughput"]),
                _fmt(m["goodput"], 2),
                _fmt(run["mean_prompt_tokens"]),
            ]
            for run in runs
            for m in [run["metrics"]]
        ],
    )
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_latency_ms", "End-to-end latency"),
    ):
        lines += [f"## {name} (ms)", ""]
        lines += _table(
            ["arm", "rate", "mean", "p50", "p90", "p99"],
            [
                [run["arm"], _rate(run["rate"])]
                + [_fmt(run["metrics"][key][s]) for s in ("mean", "p50", "p90", "p99")]
                for run in runs
            ],
        )
    lines += _prefix_cache_markdown(runs)
    lines += _comparison_markdown(report["ratios"])
    lines += _pictures_markdown(report)
    errors = [(run, msg, n) for run in runs for msg, n in run["errors"].items()]
    if errors:
        lines += ["## Errors", ""]
        lines += [
            f"- {run['arm']} @ {_rate(run['rate'])} req/s: {n} x `{msg}`" for run, msg, n in errors
        ]
        lines += [""]
    if report["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in report["notes"]] + [""]
    lines += verdict_markdown(report["comparison"], _rate)
    lines += _answers_markdown(report.get("identical_answers", []))
    for name in report["files"].get("verdict_plots", []):
        caption = "Each metric's difference from the first arm, with its 95% interval"
        lines += [f"**{caption}** (`{name}`)", "", f"![{caption}]({name})", ""]
    return "\n".join(lines)


def _answers_markdown(entries: list[dict[str, Any]]) -> list[str]:
    """report.md's "Identical greedy answers" (bench/answers.py; docs/bench.md)."""
    if not entries:
        return []
    lines = ["## Identical greedy answers", ""]
    lines += [f"- @ {_rate(e['rate'])} req/s: {e['sentence']}" for e in entries]
    return [*lines, ""]


def _headline(entries: list[dict[str, Any]]) -> list[str]:
    """One line per compared arm: its significant differences, the answer in brief."""
    groups: dict[tuple[Any, str, str], list[dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault((entry["rate"], entry["arm"], entry["baseline"]), []).append(entry)
    lines = []
    for (rate, arm, baseline), rows in groups.items():
        found = [row["sentence"].removeprefix(f"{arm} ") for row in rows if row["significant"]]
        answer = "; ".join(found) if found else "no significant difference in any metric"
        lines.append(f"- **{arm}** against **{baseline}** at {_rate(rate)} req/s: {answer}")
    return [*lines, "", "The verdict, metric by metric, closes this report.", ""] if lines else []


def _prefix_cache_markdown(runs: list[dict[str, Any]]) -> list[str]:
    """The prefix cache hit rate per run (from usage), and TTFT by turn for conversations."""
    caches = [run.get("prefix_cache") or {} for run in runs]
    if not any(c.get("hit_rate") is not None or c.get("ttft_ms_later_turns") for c in caches):
        return []
    rows = []
    for run, cache in zip(runs, caches, strict=True):
        rate = cache.get("hit_rate")
        first, later = (
            cache.get("ttft_ms_first_turns") or {},
            cache.get("ttft_ms_later_turns") or {},
        )
        rows.append(
            [
                run["arm"],
                _rate(run["rate"]),
                "-" if rate is None else f"{100 * rate:.1f}%",
                _fmt(cache.get("cached_tokens")),
                _fmt(cache.get("prompt_tokens")),
                _fmt(first.get("p50")),
                _fmt(later.get("p50")),
            ]
        )
    header = ["arm", "rate", "cache hit rate", "cached tokens", "prompt tokens"]
    header += ["p50 TTFT turn 1 (ms)", "p50 TTFT later turns (ms)"]
    intro = "Prompt tokens served from the server's prefix cache (usage `cached_tokens`)."
    return ["## Prefix cache", "", intro, "", *_table(header, rows)]


def _comparison_markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "## Ratios to the first arm",
        "",
        "Ratios arm / baseline at the same rate (first repeat): above 1 is better for "
        "throughputs, below 1 is better for latencies. The verdict below says which "
        "differences are more than noise.",
        "",
    ]
    header = ["arm", "baseline", "rate"] + [key for key, _, _ in COMPARED]
    body = [
        [row["arm"], row["baseline"], _rate(row["rate"])]
        + [
            _fmt(row[f"{key}_ratio"], 2) + ("x" if row[f"{key}_ratio"] else "")
            for key, _, _ in COMPARED
        ]
        for row in rows
    ]
    return lines + _table(header, body)


def _pictures_markdown(report: dict[str, Any]) -> list[str]:
    plots = report["files"]["plots"]
    lines = ["## Pictures", ""]
    captions = {
        "latency_cdf": "Latency CDFs (TTFT and end-to-end), one line per arm",
        "carousel": "The carousel picture: batch seats over engine iterations, one colour "
        "per request, grey = empty seat",
        "sweep": "Throughput and p99 latency against the offered rate",
    }
    for name in plots:
        caption = next((c for k, c in captions.items() if name.startswith(k)), name)
        lines += [f"**{caption}** (`{name}`)", "", f"![{caption}]({name})", ""]
    if not any(p.startswith("carousel") for p in plots):
        lines += [
            "No carousel picture: the server's iteration trace (`GET /debug/trace`) was not "
            "available; see the notes.",
            "",
        ]
    return lines
