"""The bench's verdict: every arm against the first, per rate, over the runs that ran.

Both arms of a rate ran the same workloads (repeat r on seed + r, or the replayed record), so
the resampling is paired (bench/verdict.py). The bootstrap's generator is seeded from `--seed`,
so one report gives the same intervals when it is written again. Each entry also says whether
the two arms ran the same iteration schedule (`same_schedule`, bench/schedule.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bench.metrics import Slo
from bench.runner import BenchResult, RunRecord, arm_name
from bench.schedule import SAME_SCHEDULE_SIMILARITY, schedule_similarity
from bench.verdict import DEFAULT_EQUIVALENCE_MARGIN, RunSample, compare_runs, run_sample


def _sample(run: RunRecord, slo: Slo, user: str | None = None) -> RunSample:
    """The run's samples; with `user`, only that user's requests (the others stay NaN)."""
    results = [r for r in run.results if user is None or r.user == user]
    return run_sample(results, run.num_requests, run.outcome.duration_s, slo)


def bench_comparison(
    result: BenchResult,
    arms: list[str | None],
    slo: Slo,
    num_resamples: int,
    seed: int = 0,
    user: str | None = None,
    margin: float = DEFAULT_EQUIVALENCE_MARGIN,
) -> list[dict[str, Any]]:
    """The `comparison` entries of report.json (each with its `rate`), baseline = `arms[0]`;
    with `user` (`--verdict-user`), over that user's requests only."""
    if len(arms) < 2:
        return []
    rng = np.random.default_rng([seed, 16])
    names = [arm_name(a) for a in arms]
    entries: list[dict[str, Any]] = []
    rates = list(dict.fromkeys(run.rate for run in result.runs))
    for rate in rates:
        by_arm: dict[str, list[RunRecord]] = {}
        for run in result.runs:
            if run.rate == rate:
                by_arm.setdefault(run.arm, []).append(run)
        base_runs = sorted(by_arm.get(names[0], []), key=lambda r: r.repeat)
        if not base_runs:
            continue
        base = [_sample(run, slo, user) for run in base_runs]
        for name in names[1:]:
            runs = sorted(by_arm.get(name, []), key=lambda r: r.repeat)
            if not runs:
                continue
            rows = compare_runs(
                names[0],
                base,
                name,
                [_sample(run, slo, user) for run in runs],
                slo_active=slo.active,
                rng=rng,
                num_resamples=num_resamples,
                margin=margin,
            )
            num = min(len(base_runs), len(runs))
            score = schedule_similarity(
                [r.trace for r in base_runs[:num]], [r.trace for r in runs[:num]]
            )
            same = None if score is None else score >= SAME_SCHEDULE_SIMILARITY
            schedule = {"same_schedule": same, "schedule_similarity": score}
            entries += [{"rate": rate, **row, **schedule} for row in rows]
    return entries


def verdict_markdown(entries: list[dict[str, Any]], rate_text: Callable[[Any], str]) -> list[str]:
    """report.md's "Verdict": one sentence per metric, grouped by arm and rate."""
    if not entries:
        return []
    first = entries[0]
    lines = [
        "## Verdict",
        "",
        f"Each arm against **{first['baseline']}** (the first arm): differences relative to it "
        f"(arm / {first['baseline']} - 1) with 95% intervals, {first['method']}. "
        "A metric is significant when its interval excludes 0; equivalent (no difference "
        f"larger than {first.get('equivalence_margin', 0.05):.0%}) when its 90% interval lies "
        "inside the margin (two one-sided tests); inconclusive when neither.",
        "",
    ]
    if not first.get("replicated", True):
        lines += [
            "**One run per arm**: run-to-run variation is unmeasured (the load of the machine "
            "during a run shifts all of its requests), so every outcome is inconclusive; "
            "rerun with `--repeats 3` or more.",
            "",
        ]
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault((entry["rate"], entry["arm"]), []).append(entry)
    for (rate, arm), rows in groups.items():
        lines += [f"### {arm} against {rows[0]['baseline']} @ {rate_text(rate)} req/s", ""]
        if rows[0].get("same_schedule"):
            lines += [
                f"**same schedule**: {arm} and {rows[0]['baseline']} ran identical iteration "
                "schedules (batch sizes, prefill and decode tokens, in order); the policy "
                "changed nothing here.",
                "",
            ]
        for row in rows:
            mark = {True: "**better**: ", False: "**worse**: "}.get(row["better"], "")
            note = f" _({row['note']})_" if row["note"] and row["significant"] is not None else ""
            lines.append(f"- {mark}{row['sentence']}{note}")
        lines.append("")
    return lines
