"""`carousel bench`: the command line, plugged into the gateway CLI by `register`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from bench.client import ClientConfig
from bench.exact_prompts import UNMEASURED
from bench.extra import missing_message, missing_modules
from bench.kernels_wait import (
    DEFAULT_WAIT_S,
    KernelsNotReady,
    serving_kernels,
    switched,
    wait_for_kernels,
)
from bench.metrics import Slo, parse_slo
from bench.probe import ProbeError, default_model, measure_prompt_cost, probe_arms
from bench.public_traces import FORMATS, detect_format, load_trace
from bench.replay import load_records, replay_workload
from bench.runner import BenchConfig, run_bench
from bench.summary import terminal_lines
from bench.trace import server_root
from bench.trace_replay import select_rows, trace_workload
from bench.workload import (
    PRESETS,
    DatasetEntry,
    RequestSpec,
    add_shared_prefix,
    assign_mix,
    build_conversations,
    build_workload,
    load_dataset,
    parse_deadline_mix,
    parse_dist,
    parse_mix,
    parse_rate,
    parse_rates,
)

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_OK, EXIT_NO_SUCCESS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DESCRIPTION = (
    "Benchmark an OpenAI-compatible endpoint with streamed requests: the same workload "
    "against each --arm in turn (header X-Carousel-Arm), then report.json, report.md and "
    "PNG plots, including the carousel picture of each engine's batch seats."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand (`func=run`) and `ab report` (bench/ab.py) to the gateway CLI."""
    parser = subparsers.add_parser(
        "bench", help="benchmark an endpoint and compare arms", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    from bench import ab

    ab.register(subparsers)


def _arg_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """Wrap a parser so its ValueError becomes argparse's usage error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = name
    return convert


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"must be 0 or more, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All `bench` flags (see docs/bench.md)."""
    presets = ", ".join(PRESETS)
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        "--base-url",
        default=DEFAULT_URL,
        help="OpenAI base URL (/v1 is added when the URL has no path; "
        f"default: {DEFAULT_URL}, where `carousel serve` listens)",
    )
    target.add_argument(
        "--model",
        default=None,
        help="the model name sent in requests (default: the one model /v1/models lists; "
        "with a traffic record, the recorded one)",
    )
    target.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME",
        help="an arm to run (repeatable); sent as X-Carousel-Arm: NAME",
    )
    target.add_argument(
        "--endpoint",
        choices=("chat", "completions", "responses"),
        default="chat",
        help="/v1/chat/completions, /v1/completions or /v1/responses (default: chat)",
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    target.add_argument(
        "--timeout",
        type=_arg_type(_positive_float, "seconds"),
        default=600.0,
        help="per-request timeout in seconds, streaming included (default: 600)",
    )
    target.add_argument(
        "--temperature",
        type=_arg_type(_non_negative_float, "a temperature"),
        default=0.0,
        help="sampling temperature of the bench's own requests (default: 0, greedy; a "
        "sampled burst's answers do not loop as greedy ones with ignore_eos may)",
    )
    target.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that reject it; outputs "
        "may then stop before max_tokens)",
    )

    load = parser.add_argument_group("workload")
    load.add_argument(
        "--num-requests",
        "--num-prompts",
        "--max-requests",
        dest="num_requests",
        type=_arg_type(_positive_int, "count"),
        default=None,
        help="requests per run (default: 100, the dataset's size, or the whole --replay)",
    )
    load.add_argument(
        "--rate",
        "--request-rate",
        dest="rate",
        type=_arg_type(parse_rate, "rate"),
        default=math.inf,
        help="mean arrival rate in req/s, or inf for one burst (default: inf)",
    )
    load.add_argument(
        "--sweep-rates",
        type=_arg_type(parse_rates, "rates"),
        default=None,
        metavar="R1,R2,...",
        help="run every arm at each rate (overrides --rate)",
    )
    load.add_argument(
        "--burstiness",
        type=_arg_type(_positive_float, "burstiness"),
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, "
        "<1 burstier, >1 more regular (default: 1)",
    )
    load.add_argument(
        "--input-len",
        type=_arg_type(lambda t: parse_dist(t, "input"), "DIST"),
        default=parse_dist("orca", "input"),
        metavar="DIST",
        help=f"prompt length: fixed:N, uniform:LO:HI, "
        f"lognormal:MEDIAN:SIGMA[:CAP] or a preset ({presets}); default: orca",
    )
    load.add_argument(
        "--output-len",
        type=_arg_type(lambda t: parse_dist(t, "output"), "DIST"),
        default=parse_dist("orca", "output"),
        metavar="DIST",
        help="output length (max_tokens), same forms; default: orca",
    )
    load.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        default=None,
        help='prompts, one {"prompt": ...} or {"messages": [...]} per line, '
        'optional "max_tokens"; replaces --input-len',
    )
    load.add_argument(
        "--replay",
        nargs="+",
        metavar="FILE",
        default=None,
        help="replay a trace at its arrival times: a Carousel traffic record, an Azure LLM "
        "inference CSV, a BurstGPT CSV, a Mooncake JSONL or ShareGPT JSON (see "
        "--replay-format); replaces the synthetic workload",
    )
    load.add_argument(
        "--replay-format",
        choices=FORMATS,
        default="auto",
        help="the --replay file's format (default: auto, from its content)",
    )
    load.add_argument(
        "--replay-start",
        type=_arg_type(_non_negative_float, "seconds"),
        default=0.0,
        metavar="S",
        help="with a public trace: start S seconds after its first request (default: 0)",
    )
    load.add_argument(
        "--time-scale",
        type=_arg_type(_positive_float, "scale"),
        default=1.0,
        metavar="X",
        help="with --replay: multiply the recorded gaps by X (0.5: twice as fast; default: 1)",
    )
    load.add_argument(
        "--pin-lengths",
        action="store_true",
        help="with --replay: every request generates exactly its recorded completion tokens "
        "(redacted records always do)",
    )
    load.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    load.add_argument(
        "--users",
        type=_arg_type(parse_mix, "mix"),
        default=None,
        metavar="NAME:SHARE,...",
        help="send each request for a user drawn by share (the body's `user`), "
        "e.g. heavy:9,light:1",
    )
    load.add_argument(
        "--deadline-mix",
        type=_arg_type(parse_deadline_mix, "mix"),
        default=None,
        metavar="MS:SHARE,...",
        help="give each request a first-token deadline drawn by share (the "
        "X-Carousel-Deadline-Ms header; goodput then holds each request to its own)",
    )
    load.add_argument(
        "--warmups",
        type=_arg_type(_non_negative_int, "count"),
        default=1,
        help="unmeasured requests sent to each arm before its run (default: 1)",
    )
    load.add_argument(
        "--kernels-wait-s",
        type=_arg_type(_non_negative_float, "seconds"),
        default=DEFAULT_WAIT_S,
        help="wait up to this long for a Carousel arm's CPU kernels, still building in the "
        "background, to serve before measuring; refuse after it (default: %(default)g)",
    )
    load.add_argument(
        "--max-concurrency",
        type=_arg_type(_positive_int, "count"),
        default=None,
        help="at most this many requests in flight",
    )

    load.add_argument(
        "--repeats",
        type=_arg_type(_positive_int, "count"),
        default=1,
        help="run every arm N times (repeat r with seed + r, arm order reversed on odd "
        "repeats); the verdict then resamples runs as well as requests (default: 1)",
    )
    sharing = parser.add_argument_group("prefix sharing (for prefix caches)")
    sharing.add_argument(
        "--shared-prefix-len",
        type=_arg_type(_non_negative_int, "words"),
        default=0,
        metavar="N",
        help="every conversation starts with the same N-word system prompt (about N tokens)",
    )
    sharing.add_argument(
        "--multi-turn",
        type=_arg_type(_positive_int, "turns"),
        default=1,
        metavar="K",
        help="conversations of K turns (--num-requests conversations): each turn is sent "
        "when the previous answer arrived, resending the history (default: 1)",
    )

    out = parser.add_argument_group("report")
    out.add_argument(
        "--slo",
        type=_arg_type(parse_slo, "SLO"),
        default=None,
        metavar="ttft=2s,tpot=200ms",
        help="objectives for goodput (units ms, s or us); the same as --slo-ttft/--slo-tpot",
    )
    out.add_argument(
        "--resamples",
        type=_arg_type(_positive_int, "count"),
        default=2000,
        help="bootstrap resamples behind the verdict's 95%% intervals (default: 2000)",
    )
    out.add_argument(
        "--equivalence-margin",
        type=_arg_type(_positive_float, "relative margin"),
        default=0.05,
        help="the verdict calls two arms equivalent on a metric when a TOST rules out a "
        "relative difference this large (default: 0.05, i.e. 5%%)",
    )
    out.add_argument(
        "--slo-ttft",
        type=_arg_type(_positive_float, "ms"),
        default=None,
        metavar="MS",
        help="TTFT objective in ms, for goodput",
    )
    out.add_argument(
        "--slo-tpot",
        type=_arg_type(_positive_float, "ms"),
        default=None,
        metavar="MS",
        help="TPOT objective in ms, for goodput",
    )
    out.add_argument(
        "--out",
        "--result-dir",
        dest="out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: bench-results/<timestamp>)",
    )
    out.add_argument(
        "--no-trace",
        dest="fetch_trace",
        action="store_false",
        help="do not fetch /debug/trace (no carousel picture)",
    )
    out.add_argument(
        "--verdict-user",
        default=None,
        metavar="NAME",
        help="compute the verdict over this user's requests only (with --users)",
    )
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def api_base(url: str) -> str:
    """The OpenAI base URL: `/v1` appended when the URL has no path."""
    base = url.rstrip("/")
    if not urlsplit(base).path:
        base += "/v1"
    return base


def slo_of(args: argparse.Namespace) -> Slo:
    """The SLO from `--slo` and/or `--slo-ttft`/`--slo-tpot`; ValueError when both set one."""
    slo = getattr(args, "slo", None) or Slo()
    ttft, tpot = getattr(args, "slo_ttft", None), getattr(args, "slo_tpot", None)
    if (ttft is not None and slo.ttft_ms is not None) or (
        tpot is not None and slo.tpot_ms is not None
    ):
        raise ValueError("--slo and --slo-ttft/--slo-tpot both set one objective")
    return Slo(ttft if ttft is not None else slo.ttft_ms, tpot if tpot is not None else slo.tpot_ms)


def build_config(args: argparse.Namespace, num_requests: int) -> BenchConfig:
    """Turn parsed flags into a BenchConfig."""
    arms: list[str | None] = list(dict.fromkeys(args.arm)) or [None]
    out_dir = args.out or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    client = ClientConfig(
        api_base=api_base(args.url),
        model=args.model or "(recorded)",
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
        max_concurrency=args.max_concurrency,
    )
    return BenchConfig(
        client=client,
        arms=arms,
        num_requests=num_requests,
        rates=args.sweep_rates or [args.rate],
        burstiness=args.burstiness,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        seed=args.seed,
        slo=slo_of(args),
        out_dir=out_dir,
        url=args.url,
        progress=args.progress,
        fetch_trace=args.fetch_trace,
        warmups=args.warmups,
        repeats=args.repeats,
        num_resamples=args.resamples,
        equivalence_margin=args.equivalence_margin,
        shared_prefix_len=args.shared_prefix_len,
        multi_turn=args.multi_turn,
        users=args.users,
        deadlines=args.deadline_mix,
        verdict_user=args.verdict_user,
    )


def _replay_format(args: argparse.Namespace) -> str:
    """The format of the --replay files: named, or found from the first file's content."""
    fmt = args.replay_format
    if fmt == "auto":
        fmts = {detect_format(path) for path in args.replay}
        if len(fmts) > 1:
            raise ValueError(f"the --replay files hold different formats: {sorted(fmts)}")
        fmt = fmts.pop()
    if fmt != "carousel" and len(args.replay) > 1:
        raise ValueError(f"give one {fmt} trace to --replay")
    return str(fmt)


def _replay_config(args: argparse.Namespace) -> tuple[BenchConfig, list[RequestSpec]]:
    """The config and requests of a traffic record; ValueError (or OSError) for a usage error."""
    if args.dataset or args.sweep_rates or args.rate != math.inf:
        raise ValueError("--replay replaces --dataset, --rate and --sweep-rates")
    records, skipped = load_records(args.replay)
    records = records[: args.num_requests] if args.num_requests else records
    if not records:
        raise ValueError("the traffic record holds no request the bench can send")
    workload = replay_workload(
        records,
        time_scale=args.time_scale,
        model=args.model,
        pin_lengths=args.pin_lengths,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    info = {"files": [str(p) for p in args.replay], **workload.info, "skipped": dict(skipped)}
    cfg = dataclasses.replace(
        build_config(args, len(workload.specs)),
        rates=[workload.offered_rate],
        offsets=workload.offsets,
        replay=info,
    )
    return cfg, workload.specs


def _trace_config(args: argparse.Namespace, fmt: str) -> tuple[BenchConfig, list[RequestSpec]]:
    """The config and requests of a public trace (bench/trace_replay.py): the prompt's token
    cost is measured on the first arm before the prompts are drawn."""
    if args.dataset or args.sweep_rates:
        raise ValueError("--replay replaces --dataset and --sweep-rates")
    rows = load_trace(args.replay[0], fmt)  # type: ignore[arg-type]
    if fmt != "sharegpt" and args.rate != math.inf:
        raise ValueError(f"a {fmt} trace has its own arrival times: no --rate")
    rows = select_rows(rows, args.replay_start, args.num_requests)
    if not rows:
        raise ValueError(f"no request of the trace starts at or after {args.replay_start:g} s")
    cfg = build_config(args, len(rows))
    cost = measure_prompt_cost(cfg.client, cfg.arms[0], cfg.client.endpoint) or UNMEASURED
    workload = trace_workload(
        rows,
        fmt,  # type: ignore[arg-type]
        cost,
        time_scale=args.time_scale,
        rate=args.rate,
        burstiness=args.burstiness,
        seed=args.seed,
    )
    info = {
        "files": [str(p) for p in args.replay],
        **workload.info,
        "start_s": args.replay_start,
        "endpoints": {cfg.client.endpoint: len(rows)},
    }
    cfg = dataclasses.replace(
        cfg, rates=[workload.offered_rate], offsets=workload.offsets, replay=info
    )
    return cfg, workload.specs


def sharing_workload(
    cfg: BenchConfig, dataset: list[DatasetEntry] | None, seed: int
) -> list[RequestSpec]:
    """The requests of a run (drawn with `seed`), with `--multi-turn` conversations and a
    `--shared-prefix-len` system prompt when asked."""
    if cfg.multi_turn > 1:
        specs = build_conversations(
            cfg.num_requests, cfg.multi_turn, cfg.input_len, cfg.output_len, seed
        )
    else:
        specs = build_workload(cfg.num_requests, cfg.input_len, cfg.output_len, seed, dataset)
    if cfg.shared_prefix_len:
        specs = add_shared_prefix(specs, cfg.shared_prefix_len, cfg.seed)
    if cfg.users or cfg.deadlines:
        specs = assign_mix(specs, seed, cfg.users, cfg.deadlines)
    return specs


def run(args: argparse.Namespace) -> int:
    """Run the bench; 0 on success, 1 when the probe failed or no request completed, 2 for
    usage errors, 130 when interrupted."""
    missing = missing_modules()
    if missing:
        print(f"carousel bench: {missing_message(missing)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        fmt = _replay_format(args) if args.replay else None
    except (OSError, ValueError) as exc:
        print(f"carousel bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if not args.model and fmt != "carousel":
            args.model = default_model(api_base(args.url), args.api_key)
        cfg, workloads = _workloads(args, fmt)
    except ProbeError as exc:
        print(f"carousel bench: {exc}", file=sys.stderr)
        return EXIT_NO_SUCCESS
    except (OSError, ValueError) as exc:
        print(f"carousel bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    specs = workloads[0]
    root = server_root(cfg.client.api_base)

    def read_kernels() -> dict[str, str]:
        return serving_kernels(root, cfg.client.api_key)

    try:
        before = wait_for_kernels(read_kernels, args.kernels_wait_s, say=_say)
    except KernelsNotReady as exc:
        print(f"carousel bench: nothing was run: {exc}", file=sys.stderr)
        return EXIT_NO_SUCCESS
    try:
        probes = probe_arms(cfg.client, specs[0], cfg.arms)
    except ProbeError as exc:
        print(f"carousel bench: the probe request failed, nothing was run: {exc}", file=sys.stderr)
        return EXIT_NO_SUCCESS
    refused = tuple(p.arm for p in probes if not p.accepts_ignore_eos)
    cfg = dataclasses.replace(cfg, ignore_eos_refused=refused)
    notes = [p.note for p in probes if p.note]
    if cfg.replay and cfg.replay.get("exact_prompt_lengths") is False:
        notes.append("prompt lengths are approximate: the server reported no prompt tokens")
    for note in notes:
        print(f"carousel bench: {note}", file=sys.stderr)
    try:
        result = asyncio.run(run_bench(cfg, workloads))
    except KeyboardInterrupt:
        print("carousel bench: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    after = read_kernels()
    result.kernels = {"before": before, "after": after, "switched": switched(before, after)}
    from bench.report import write_report

    report_path = write_report(cfg, specs, result)
    report = json.loads(report_path.read_text(encoding="utf-8"))
    print("\n".join(terminal_lines(report, notes)))
    print(f"report: {report_path} and {report_path.with_suffix('.md')}")
    if result.interrupted:
        return EXIT_INTERRUPTED
    if result.kernels["switched"]:
        mixed = "; ".join(result.kernels["switched"])
        print(f"carousel bench: invalid run: it mixed two paths ({mixed})", file=sys.stderr)
        return EXIT_NO_SUCCESS
    if not any(run.metrics["completed"] for run in result.runs):
        errors = [e for run in report["runs"] for e in run["errors"]]
        why = errors[0] if errors else "no request was sent"
        print(f"carousel bench: no request succeeded: {why}", file=sys.stderr)
        return EXIT_NO_SUCCESS
    return EXIT_OK


def _say(line: str) -> None:
    print(f"carousel bench: {line}", file=sys.stderr)


def _workloads(
    args: argparse.Namespace, fmt: str | None
) -> tuple[BenchConfig, list[list[RequestSpec]]]:
    """The config and each repeat's requests, from the flags."""
    if fmt == "carousel":
        cfg, specs = _replay_config(args)
        return cfg, [specs]
    if fmt is not None:
        cfg, specs = _trace_config(args, fmt)
        return cfg, [specs]
    dataset = load_dataset(args.dataset) if args.dataset else None
    num_requests = args.num_requests or (len(dataset) if dataset else 100)
    cfg = build_config(args, num_requests)
    if dataset and args.multi_turn > 1:
        raise ValueError("--multi-turn generates its own prompts (no --dataset)")
    return cfg, [sharing_workload(cfg, dataset, cfg.seed + r) for r in range(cfg.repeats)]


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m bench`)."""
    parser = argparse.ArgumentParser(prog="carousel bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
