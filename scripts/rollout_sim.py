"""Thousands of simulated rollouts: the rollout tests' error rates and exposures, shown.

Each rollout runs the gateway's decision core (gateway/rollout/) on synthetic traffic: TTFT,
TPOT and e2e latencies with log-normal bodies and a heavy (Pareto) tail, and per-request
errors. Every step splits its requests between the arms at the step's share; the decision is
taken at a look after every request; a step that decides nothing in `--step-requests`
requests holds (the simulator's `max_step_s`).

Scenarios (the candidate against the baseline):
- `aa`: identical arms. A false advance is any advance or promotion; a false rollback any
  rollback. Each should be at most alpha.
- `faster`: every latency of the candidate 20% lower: it should reach 100%.
- `errors`: the candidate fails 2% of requests (the baseline none); `slow_ttft`: the
  candidate's TTFT is 1.5x: each should be rolled back, early (exposure: candidate requests
  served before the rollback).
- `aa_bootstrap`: the A/A streams of a 50% split judged both by the sequential test and by
  `carousel ab report`'s bootstrap verdict (bench/verdict.py) at each of `--bootstrap-looks`
  looks, stopping on the first significant difference: the inflation the sequential test
  avoids.

The simulator pairs the k-th candidate sample of a step with the k-th baseline sample (the
pair counts from the later arrival); the gateway pairs each candidate with the most recent
unpaired baseline sample. Both choose by arrival order only, so the paired statistics have
the same distribution; only when a pair forms differs, by a request or two.

    python scripts/rollout_sim.py --rollouts 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.verdict import METRICS_BY_KEY, RunSample, compare_runs  # noqa: E402
from gateway.rollout.betting import log_e_value  # noqa: E402
from gateway.rollout.decision import Decision, first_decision  # noqa: E402
from gateway.rollout.evidence import tail_thresholds  # noqa: E402
from gateway.rollout.spec import RolloutSpec, TestSpec, build_spec  # noqa: E402
from gateway.settings.rollout import RolloutSettings  # noqa: E402

Arrays = dict[str, np.ndarray]
Draw = Callable[[np.random.Generator, int], Arrays]
#: the first prefix of a step's stream the tests are computed on (doubled until a decision)
FIRST_PREFIX = 2000

DEFAULT_SETTINGS = RolloutSettings(
    baseline="baseline",
    candidate="candidate",
    steps=[5, 25, 50, 100],
    metric="ttft_p50",
    guardrails={"error_rate": 0.005, "ttft_p99": 0.10, "tpot_p50": 0.10},
    min_requests=100,
    on_no_difference="hold",
    alpha=0.05,
)


def traffic(ttft_scale: float = 1.0, tpot_scale: float = 1.0, error_rate: float = 0.0) -> Draw:
    """Requests with log-normal latencies, 3% of them in a Pareto(1.5) tail (x 1 to ~10+)."""

    def draw(rng: np.random.Generator, n: int) -> Arrays:
        tail = np.where(rng.random(n) < 0.03, 1 + rng.pareto(1.5, n), 1.0)
        ttft = rng.lognormal(np.log(200.0), 0.5, n) * tail * ttft_scale
        tpot = rng.lognormal(np.log(20.0), 0.3, n) * tpot_scale
        out_tokens = rng.integers(16, 256, n)
        e2e = ttft + tpot * out_tokens
        error = (rng.random(n) < error_rate).astype(float)
        failed = error > 0
        for values in (ttft, tpot, e2e):
            values[failed] = np.nan
        return {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e, "error": error}

    return draw


SCENARIOS: dict[str, Draw] = {
    "aa": traffic(),
    "faster": traffic(ttft_scale=0.8, tpot_scale=0.8),
    "errors": traffic(error_rate=0.02),
    "slow_ttft": traffic(ttft_scale=1.5),
}


@dataclass
class StepStream:
    """One step's requests: who served each, and each arm's samples in arrival order."""

    candidate: np.ndarray  # (n,) bool
    base: Arrays
    cand: Arrays

    @classmethod
    def draw(cls, rng: np.random.Generator, share: float, n: int, candidate: Draw) -> StepStream:
        is_candidate = rng.random(n) < share
        num_c = int(is_candidate.sum())
        return cls(is_candidate, SCENARIOS["aa"](rng, n - num_c), candidate(rng, num_c))

    def prefix(self, n: int) -> StepStream:
        """The step's first `n` requests (every statistic is causal: the same looks)."""
        num_c = int(self.candidate[:n].sum())
        base = {k: v[: n - num_c] for k, v in self.base.items()}
        return StepStream(self.candidate[:n], base, {k: v[:num_c] for k, v in self.cand.items()})


def step_log_e(spec: RolloutSpec, stream: StepStream) -> dict[str, np.ndarray]:
    """Per test, its log e-value after each request of the step (a look after every one)."""
    n = stream.candidate.size
    base_pos = np.flatnonzero(~stream.candidate)
    cand_pos = np.flatnonzero(stream.candidate)
    return {t.name: _test_log_e(t, stream, base_pos, cand_pos, n) for t in spec.tests}


def _test_log_e(
    test: TestSpec, stream: StepStream, base_pos: np.ndarray, cand_pos: np.ndarray, n: int
) -> np.ndarray:
    b_all, c_all = stream.base[test.field], stream.cand[test.field]
    b_ok, c_ok = np.isfinite(b_all), np.isfinite(c_all)
    b, c, pb, pc = b_all[b_ok], c_all[c_ok], base_pos[b_ok], cand_pos[c_ok]
    if test.kind == "paired":
        k = min(b.size, c.size)
        x = test.statistic(b[:k], c[:k])
        at = np.maximum(pb[:k], pc[:k])
    else:
        thresholds = tail_thresholds(b)
        seen = np.searchsorted(pb, pc)  # baseline samples before each candidate sample
        threshold = np.where(seen > 0, thresholds[np.maximum(seen - 1, 0)], np.nan)
        scored = np.isfinite(threshold)
        x = test.statistic(threshold[scored], c[scored])
        at = pc[scored]
    if x.size == 0:
        return np.zeros(n)
    log_e = log_e_value(np.cumsum(test.test.increments(x), axis=0))
    last = np.searchsorted(at, np.arange(n), side="right") - 1
    return np.where(last >= 0, log_e[np.maximum(last, 0)], 0.0)


@dataclass
class Outcome:
    """How one rollout ended and what it cost."""

    final: str  # "promoted" | "rolled_back" | "held"
    advanced: bool = False
    requests_per_step: list[int] = field(default_factory=list)  # requests each passed step took
    exposure: int = 0  # candidate requests served before the end


def simulate(
    rng: np.random.Generator, spec: RolloutSpec, candidate: Draw, step_requests: int
) -> Outcome:
    """One rollout, step by step, until promoted, rolled back, or holding."""
    outcome = Outcome("held")
    carried: dict[str, float] = {}
    for share in spec.settings.steps[:-1]:
        whole = StepStream.draw(rng, share / 100, step_requests, candidate)
        _, n_b, n_c, log_e, decision = _first_decision_of(spec, whole, carried)
        end = decision.index if decision is not None else n_c.size - 1
        outcome.exposure += int(n_c[end])
        if decision is None or decision.kind == "hold":
            return outcome
        if decision.kind == "rollback":
            outcome.final = "rolled_back"
            return outcome
        outcome.advanced = True
        outcome.requests_per_step.append(decision.index + 1)
        if decision.kind == "promote":
            break
        for test in spec.of_role("guardrail"):
            carried[test.name] = carried.get(test.name, 0.0) + float(log_e[test.name][end])
    outcome.final = "promoted"
    return outcome


def _first_decision_of(
    spec: RolloutSpec, whole: StepStream, carried: dict[str, float]
) -> tuple[StepStream, np.ndarray, np.ndarray, dict[str, np.ndarray], Decision | None]:
    """The step's first decision, computed on growing prefixes of its stream (cheap when it
    comes early; the same as on the whole stream, since every statistic is causal)."""
    size = min(FIRST_PREFIX, whole.candidate.size)
    while True:
        stream = whole.prefix(size)
        log_e = step_log_e(spec, stream)
        n_c = np.cumsum(stream.candidate)
        n_b = np.arange(1, n_c.size + 1) - n_c
        decision = first_decision(spec, n_b, n_c, log_e, carried=carried)
        if decision is not None and decision.kind == "hold":
            decision = _rollback_while_holding(spec, n_b, n_c, log_e, carried, decision)
            if decision.kind == "hold" and size < whole.candidate.size:
                size = min(2 * size, whole.candidate.size)  # a later rollback may still come
                continue
        if decision is not None or size == whole.candidate.size:
            return stream, n_b, n_c, log_e, decision
        size = min(2 * size, whole.candidate.size)


def _rollback_while_holding(
    spec: RolloutSpec,
    n_b: np.ndarray,
    n_c: np.ndarray,
    log_e: dict[str, np.ndarray],
    carried: dict[str, float],
    hold: Decision,
) -> Decision:
    """A holding step still rolls back if a guardrail fires later in it."""
    guards = {t.name: log_e[t.name] for t in spec.of_role("guardrail")}
    later = first_decision(spec, n_b, n_c, guards, carried=carried)
    if later is not None and later.kind == "rollback" and later.index > hold.index:
        return later
    return Decision("hold", hold.reason, n_c.size - 1)


def bootstrap_aa(
    rng: np.random.Generator, spec: RolloutSpec, requests: int, looks: int, resamples: int
) -> tuple[bool, bool, bool, bool]:
    """One A/A stream at a 50% split: (bootstrap advance, bootstrap rollback, sequential
    advance, sequential rollback), the bootstrap verdict on p50 TTFT at `looks` looks."""
    stream = StepStream.draw(rng, 0.5, requests, SCENARIOS["aa"])
    n_c = np.cumsum(stream.candidate)
    n_b = np.arange(1, n_c.size + 1) - n_c
    decision = first_decision(spec, n_b, n_c, step_log_e(spec, stream))
    seq_advance = decision is not None and decision.kind in ("advance", "promote")
    seq_rollback = decision is not None and decision.kind == "rollback"
    spec_p50 = METRICS_BY_KEY["ttft_p50"]
    for look in np.linspace(requests / looks, requests, looks).astype(int):
        nb, nc = int(n_b[look - 1]), int(n_c[look - 1])
        if min(nb, nc) < spec.settings.min_requests:
            continue
        base, cand = _run_sample(stream.base, nb), _run_sample(stream.cand, nc)
        entry = compare_runs(
            "baseline", [base], "candidate", [cand], slo_active=False, rng=rng,
            num_resamples=resamples, paired=False, metrics=[spec_p50],
        )[0]  # fmt: skip
        if entry["significant"]:
            return bool(entry["better"]), not entry["better"], seq_advance, seq_rollback
    return False, False, seq_advance, seq_rollback


def _run_sample(arrays: Arrays, n: int) -> RunSample:
    nan = np.full(n, np.nan)
    empty = np.zeros(0)
    ttft = arrays["ttft_ms"][:n]
    return RunSample(ttft, nan, nan, np.zeros(n), nan, empty, empty.astype(int), None)


def _median_p90(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{np.median(values):.0f} / {np.percentile(values, 90):.0f}"


def report(args: argparse.Namespace, spec: RolloutSpec) -> list[str]:
    """The table of rates and exposures (Markdown), one row per scenario."""
    rng = np.random.default_rng(args.seed)
    rows = [
        "| scenario | rollouts | advanced | promoted | rolled back | held | requests to each "
        "step (median) | exposure at rollback (median / p90) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.scenarios:
        outcomes = [
            simulate(rng, spec, SCENARIOS[name], args.step_requests) for _ in range(args.rollouts)
        ]
        share = {k: np.mean([o.final == k for o in outcomes]) for k in ("promoted", "rolled_back")}
        held = np.mean([o.final == "held" for o in outcomes])
        advanced = np.mean([o.advanced for o in outcomes])
        per_step = [
            np.median([o.requests_per_step[i] for o in outcomes if len(o.requests_per_step) > i])
            for i in range(len(spec.settings.steps) - 1)
            if any(len(o.requests_per_step) > i for o in outcomes)
        ]
        steps = ", ".join(f"{s:.0f}" for s in per_step) or "-"
        exposure = _median_p90([o.exposure for o in outcomes if o.final == "rolled_back"])
        rows.append(
            f"| {name} | {len(outcomes)} | {advanced:.3f} | {share['promoted']:.3f} | "
            f"{share['rolled_back']:.3f} | {held:.3f} | {steps} | {exposure} |"
        )
    if args.bootstrap_rollouts:
        rows += ["", *bootstrap_rows(rng, spec, args)]
    return rows


def bootstrap_rows(
    rng: np.random.Generator, spec: RolloutSpec, args: argparse.Namespace
) -> list[str]:
    results = np.asarray(
        [
            bootstrap_aa(rng, spec, args.bootstrap_requests, args.bootstrap_looks, args.resamples)
            for _ in range(args.bootstrap_rollouts)
        ]
    )
    boot_adv, boot_rb, seq_adv, seq_rb = results.mean(axis=0)
    return [
        f"A/A at a 50% split, {args.bootstrap_requests} requests, {args.bootstrap_rollouts} "
        "streams: false advance / false rollback on p50 TTFT",
        "",
        "| judged by | looks | false advance | false rollback |",
        "|---|---|---|---|",
        f"| bootstrap verdict (bench/verdict.py, {args.resamples} resamples) | "
        f"{args.bootstrap_looks} | {boot_adv:.3f} | {boot_rb:.3f} |",
        f"| sequential tests (gateway/rollout/) | every request | {seq_adv:.3f} | {seq_rb:.3f} |",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--step-requests", type=int, default=36_000)
    parser.add_argument("--bootstrap-rollouts", type=int, default=200)
    parser.add_argument("--bootstrap-requests", type=int, default=3000)
    parser.add_argument("--bootstrap-looks", type=int, default=30)
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    spec = build_spec(DEFAULT_SETTINGS)
    print("\n".join(report(args, spec)))
    print(f"\n({time.monotonic() - began:.1f} s, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
