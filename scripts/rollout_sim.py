"""Thousands of simulated rollouts, with load and users: the tests' error rates, power, exposure.

Each rollout runs the gateway's decision core (gateway/rollout/: its tests, its units and its
decision rule) on traffic whose latencies come from engines under load:

- Engines. Each compared arm's engine is the real `orca` scheduler on the sim's cost model
  (backends/sim_plan.py's `simulate`), fed Poisson arrivals at the rate its slice of the traffic
  gives it (`--rate` times the share of the step's requests it gets, rounded to a grid of rates
  `RATE_STEP` apart). One long stream is simulated per (engine, rate) and each step reads a
  window of it at a random offset (wrapping around), so an arm's latencies carry its load and
  its queue's memory. The candidate's engine and its reference's read windows that do not
  overlap (when they read one stream), at fresh offsets every step, and a step holds no more
  requests than a third of a stream covers per arm (`--stream-requests`; 36,000 requests,
  `--step-requests`, at 5%), so every step compares two fresh stretches of engine life.
  `faster` and `slower` candidates run every step 0.8x and 1.3x as long.
- Users. `--users` users a rollout, each at a uniform point in [0, 1) (as the gateway's hash of
  `user` gives) with a log-normal factor (sd `--user-sd`) on all its latencies; each request
  comes from a user drawn uniformly. With `assignment: user` an arm's slice of [0, 1) takes the
  users whose points fall in it (so with few users an engine's load is lumpy, as it would be),
  and each user is one sample per step (gateway/rollout/evidence.py); with `assignment:
  request` each request draws its own point, and the step's compared requests form blocks
  (`BLOCK_PER_UNIT` times `requests_per_unit`), as the gateway's requests without a user do.
- Topology. `control` (docs/rollout.md): the candidate and a control engine of the baseline's
  config each take the step's share, and the tests compare them. `baseline`: the candidate
  against the baseline's own engine at 100 - share, which the gateway now refuses at start-up
  (gateway/settings/rollout_topology.py); its rows show why.

Scenarios (the candidate against the control): `aa` identical; `faster` each step 0.8x;
`slower` each step 1.3x; `refusing` identical but answering 429 to the 20% of its requests that
would wait longest (the highest TTFTs of its stream); `dead` fails every request.

A step that decides nothing in `--step-requests` requests (all arms) holds; a holding step still
rolls back if a guardrail fires later in it. The simulator pairs the k-th candidate sample of a
step with the k-th reference sample (the pair counts from the later one); the gateway pairs each
candidate sample with the most recent unpaired reference sample. Both choose by arrival order
only, so the paired statistics have the same distribution.

    python scripts/rollout_sim.py --rollouts 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.sim import CostModel  # noqa: E402
from backends.sim_plan import Workload, simulate  # noqa: E402
from bench.verdict import METRICS_BY_KEY, RunSample, compare_runs  # noqa: E402
from gateway.rollout.betting import log_e_value  # noqa: E402
from gateway.rollout.controller import FAILING_AFTER  # noqa: E402
from gateway.rollout.decision import Decision, first_decision  # noqa: E402
from gateway.rollout.evidence import BLOCK_PER_UNIT, tail_thresholds  # noqa: E402
from gateway.rollout.spec import RolloutSpec, TestSpec, build_spec  # noqa: E402
from gateway.settings.rollout import RolloutSettings  # noqa: E402

Arrays = dict[str, np.ndarray]
FIELDS = ("ttft_ms", "tpot_ms", "e2e_ms")
#: the first prefix of a step's requests the tests are computed on (doubled until a decision)
FIRST_PREFIX = 4000
#: engine rates are rounded to this grid (a factor apart), so streams can be shared
RATE_STEP = 1.25
#: each engine kind's cost per step, relative to the baseline's
ENGINE_COST = {"same": 1.0, "faster": 0.8, "slower": 1.3}
SCENARIOS = {
    "aa": "same",
    "faster": "faster",
    "slower": "slower",
    "refusing": "same",
    "dead": "same",
}
#: the share of its requests a `refusing` candidate answers 429: those that would wait longest
REFUSED_SHARE = 0.20

DEFAULT_SETTINGS = RolloutSettings(
    baseline="baseline",
    control="control",
    candidate="candidate",
    steps=[5, 25, 50, 100],
    metric="ttft_p50",
    guardrails={"error_rate": 0.005, "ttft_p99": 0.10, "tpot_p50": 0.10},
    min_requests=100,
    on_no_difference="hold",
    alpha=0.05,
)


class Engines:
    """Long request streams of one engine kind at one rate, simulated once and kept (in
    memory, and under `cache` when given: a stream is a pure function of its key)."""

    def __init__(self, total_rate: float, stream_requests: int, cache: Path | None = None) -> None:
        self.total_rate = total_rate
        self.stream_requests = stream_requests
        self.cache = cache
        self._streams: dict[tuple[str, float], Arrays] = {}

    def rate_of(self, share: float) -> float:
        """The grid rate nearest to `share` of the total (in log space)."""
        rate = max(share, 1e-4) * self.total_rate
        return float(RATE_STEP ** np.round(np.log(rate) / np.log(RATE_STEP)))

    def stream(self, kind: str, share: float) -> Arrays:
        """The stream of this kind of engine at this share."""
        key = (kind, self.rate_of(share))
        if key not in self._streams:
            self._streams[key] = self._cached(*key)
        return self._streams[key]

    def _cached(self, kind: str, rate: float) -> Arrays:
        if self.cache is None:
            return self._simulate(kind, rate)
        path = self.cache / f"{kind}-{rate:.6g}-{self.stream_requests}.npz"
        if path.exists():
            with np.load(path) as saved:
                return {name: saved[name] for name in saved.files}
        arrays = self._simulate(kind, rate)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)
        return arrays

    def _simulate(self, kind: str, rate: float) -> Arrays:
        scale = ENGINE_COST[kind]
        base = CostModel()
        cost = dataclasses.replace(
            base,
            fixed_s=base.fixed_s * scale,
            per_token_s=base.per_token_s * scale,
            per_context_token_s=base.per_context_token_s * scale,
        )
        workload = Workload(
            rate=rate,
            num_requests=self.stream_requests,
            prompt_tokens=(32, 512),
            output_median=64,
            output_sigma=0.8,
            max_tokens=256,
            seed=int(rate * 1000) + 7,
        )
        result = simulate("orca", cost, 4096, workload.requests(), max_tokens=256, max_num_seqs=32)
        timings = result.timings
        out = {
            "ttft_ms": np.asarray([t.ttft_s for t in timings]) * 1000,
            "tpot_ms": np.asarray([t.tpot_s for t in timings]) * 1000,
            "e2e_ms": np.asarray([t.e2e_s for t in timings]) * 1000,
        }
        out["refused"] = out["ttft_ms"] > np.nanquantile(out["ttft_ms"], 1 - REFUSED_SHARE)
        return out


@dataclass(frozen=True)
class Population:
    """A rollout's users: their points in [0, 1) and their latency factors."""

    points: np.ndarray  # (U,)
    factors: np.ndarray  # (U,)

    @classmethod
    def draw(cls, rng: np.random.Generator, users: int, sd: float) -> Population:
        return cls(rng.random(users), rng.lognormal(0.0, sd, users))


@dataclass(frozen=True)
class Design:
    """What is simulated: the candidate's scenario, the topology and the split's unit."""

    scenario: str
    topology: str = "control"  # or "baseline"
    assignment: str = "user"  # or "request"
    users: int = 1000
    #: the tests' unit: "user" (a user's first requests of the step, on each arm) or
    #: "request"; None: the assignment's own
    unit: str | None = None

    @property
    def unit_kind(self) -> str:
        return self.unit or self.assignment


@dataclass
class StepTraffic:
    """One step's requests to the two compared arms, in arrival order."""

    position: np.ndarray  # (n,) index among all the step's requests (all arms)
    candidate: np.ndarray  # (n,) bool
    unit: np.ndarray  # (n,) the sample each request counts for
    values: Arrays  # each field (n,), NaN where not measured; "error" 0/1

    def prefix(self, n: int) -> StepTraffic:
        return StepTraffic(
            self.position[:n],
            self.candidate[:n],
            self.unit[:n],
            {k: v[:n] for k, v in self.values.items()},
        )


def slices(design: Design, share: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(candidate, reference) slices of [0, 1): the candidate's last, as the gateway orders."""
    candidate = (1 - share, 1.0)
    if design.topology == "control":
        return candidate, (max(0.0, 1 - 2 * share), 1 - share)
    return candidate, (0.0, 1 - share)


def draw_step(
    rng: np.random.Generator,
    design: Design,
    population: Population,
    share: float,
    requests: int,
    engines: Engines,
    per_unit: int = DEFAULT_SETTINGS.requests_per_unit,
) -> StepTraffic:
    """The step's `requests` (all arms), kept for the two compared arms."""
    users = rng.integers(0, population.points.size, requests)
    by_user = design.assignment == "user"
    points = population.points[users] if by_user else rng.random(requests)
    (c_lo, c_hi), (r_lo, r_hi) = slices(design, share)
    is_cand = (points >= c_lo) & (points < c_hi)
    is_ref = (points >= r_lo) & (points < r_hi)
    kept = np.flatnonzero(is_cand | is_ref)
    candidate = is_cand[kept]
    values = {name: np.full(kept.size, np.nan) for name in FIELDS}
    values["error"] = np.zeros(kept.size)
    kind = SCENARIOS[design.scenario]
    arms = ((True, candidate, kind), (False, ~candidate, "same"))
    offsets = _window_offsets(rng, engines, [(e, int(m.sum()) / requests) for _, m, e in arms])
    for (is_candidate, mask, engine), offset in zip(arms, offsets, strict=True):
        count = int(mask.sum())
        if count == 0:
            continue
        stream = engines.stream(engine, count / requests)
        at = (offset + np.arange(count)) % stream["ttft_ms"].size
        factor = population.factors[users[kept[mask]]]
        for name in FIELDS:
            values[name][mask] = stream[name][at] * factor
        failed = np.isnan(stream["e2e_ms"][at])
        failed |= _scenario_failures(design.scenario, stream, at, is_candidate)
        values["error"][mask] = failed
    failed = values["error"] > 0
    for name in FIELDS:
        values[name][failed] = np.nan
    if design.unit_kind == "user":
        unit = users[kept]
    else:
        unit = block_units(candidate.size, population.points.size, per_unit)
    return StepTraffic(kept, candidate, unit, values)


def block_units(count: int, first_id: int, per_unit: int) -> np.ndarray:
    """Each compared request's unit when it has no user (the gateway's StepObserver): its
    block of `BLOCK_PER_UNIT * per_unit` consecutive compared requests."""
    return np.arange(count) // (BLOCK_PER_UNIT * per_unit) + first_id


def _window_offsets(
    rng: np.random.Generator, engines: Engines, arms: list[tuple[str, float]]
) -> list[int]:
    """Where each arm's window starts in its engine's stream. Two arms that read one stream
    (the same engine at the same rate) read windows that do not overlap, at random offsets:
    every step compares two fresh stretches of the engine's life, never the same two
    realisations again (which would turn sampling noise into a fixed difference)."""
    size = engines.stream_requests
    (kind_c, share_c), (kind_r, share_r) = arms
    first = int(rng.integers(0, size))
    if (kind_c, engines.rate_of(share_c)) != (kind_r, engines.rate_of(share_r)):
        return [first, int(rng.integers(0, size))]
    count_c = round(share_c * size)  # an upper bound of the windows' lengths, in requests
    count_r = round(share_r * size)
    spare = max(1, size - count_c - count_r)
    return [first, (first + count_c + int(rng.integers(0, spare))) % size]


def _scenario_failures(
    scenario: str, stream: Arrays, at: np.ndarray, is_candidate: bool
) -> np.ndarray:
    if not is_candidate or scenario not in ("refusing", "dead"):
        return np.zeros(at.size, dtype=bool)
    if scenario == "dead":
        return np.ones(at.size, dtype=bool)
    return stream["refused"][at]


def unit_samples(
    traffic: StepTraffic, mask: np.ndarray, per_unit: int, tails: Arrays
) -> tuple[np.ndarray, Arrays]:
    """The samples of one arm's units: (their completion index into the traffic, each
    field's value: geometric means, error shares, tail shares). A unit completes at its
    `per_unit`-th request of the step; a unit that never does is no sample."""
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return np.zeros(0, dtype=int), {}
    ids, compact = np.unique(traffic.unit[idx], return_inverse=True)
    order = np.lexsort((idx, compact))
    start = np.r_[True, compact[order][1:] != compact[order][:-1]]
    first = np.maximum.accumulate(np.where(start, np.arange(idx.size), 0))
    rank = np.empty(idx.size, dtype=int)
    rank[order] = np.arange(idx.size) - first
    kept = rank < per_unit
    done = rank == per_unit - 1
    completes = np.full(ids.size, -1)
    completes[compact[done]] = idx[done]
    units = np.flatnonzero(completes >= 0)
    units = units[np.argsort(completes[units], kind="stable")]
    out: Arrays = {}
    for name, values in (*traffic.values.items(), *tails.items()):
        v = values[idx]
        ok = kept & np.isfinite(v)
        v = np.log(v) if name in FIELDS else v
        total = np.bincount(compact[ok], weights=v[ok], minlength=ids.size)
        count = np.bincount(compact[ok], minlength=ids.size)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count
        out[name] = (np.exp(mean) if name in FIELDS else mean)[units]
    return completes[units], out


def step_log_e(spec: RolloutSpec, traffic: StepTraffic, per_unit: int) -> dict[str, np.ndarray]:
    """Per test, its log e-value after each request of the traffic (a look after every one)."""
    n = traffic.candidate.size
    ref_mask, cand_mask = ~traffic.candidate, traffic.candidate
    tails = {t.name: _tail_statistic(t, traffic) for t in spec.tests if t.kind == "tail"}
    ref_at, ref = unit_samples(traffic, ref_mask, per_unit, {})
    cand_at, cand = unit_samples(traffic, cand_mask, per_unit, tails)
    out = {}
    for test in spec.tests:
        if test.kind == "paired":
            x, at = _paired(test, ref_at, ref, cand_at, cand)
        else:
            shares = cand.get(test.name, np.zeros(0))
            ok = np.isfinite(shares)
            x, at = shares[ok], cand_at[ok]
        out[test.name] = _looks(test, x, at, n)
    return out


def _tail_statistic(test: TestSpec, traffic: StepTraffic) -> np.ndarray:
    """Each candidate request's tail statistic against the reference's running p99 (NaN:
    no threshold yet, or not a candidate request)."""
    values = traffic.values[test.field]
    ref_pos = np.flatnonzero(~traffic.candidate & np.isfinite(values))
    out = np.full(values.size, np.nan)
    if ref_pos.size == 0:
        return out
    thresholds = tail_thresholds(values[ref_pos])
    seen = np.searchsorted(ref_pos, np.arange(values.size))  # reference samples before each
    threshold = np.where(seen > 0, thresholds[np.maximum(seen - 1, 0)], np.nan)
    scored = traffic.candidate & np.isfinite(threshold) & np.isfinite(values)
    out[scored] = test.statistic(threshold[scored], values[scored])
    return out


def _paired(
    test: TestSpec, ref_at: np.ndarray, ref: Arrays, cand_at: np.ndarray, cand: Arrays
) -> tuple[np.ndarray, np.ndarray]:
    if test.field not in ref or test.field not in cand:
        return np.zeros(0), np.zeros(0, dtype=int)
    b_ok, c_ok = np.isfinite(ref[test.field]), np.isfinite(cand[test.field])
    b, pb = ref[test.field][b_ok], ref_at[b_ok]
    c, pc = cand[test.field][c_ok], cand_at[c_ok]
    k = min(b.size, c.size)
    return test.statistic(b[:k], c[:k]), np.maximum(pb[:k], pc[:k])


def _looks(test: TestSpec, x: np.ndarray, at: np.ndarray, n: int) -> np.ndarray:
    """The test's log e-value after each of the `n` requests, from statistics `x` counted
    at request `at` (sorted)."""
    if x.size == 0:
        return np.zeros(n)
    order = np.argsort(at, kind="stable")
    log_e = log_e_value(np.cumsum(test.test.increments(x[order]), axis=0))
    last = np.searchsorted(at[order], np.arange(n), side="right") - 1
    return np.where(last >= 0, log_e[np.maximum(last, 0)], 0.0)


@dataclass
class Outcome:
    """How one rollout ended and what it cost."""

    final: str  # "promoted" | "rolled_back" | "held"
    advanced: bool = False
    requests_per_step: list[int] = field(default_factory=list)  # all arms, each passed step
    exposure: int = 0  # candidate requests served before the end


def simulate_rollout(
    rng: np.random.Generator,
    spec: RolloutSpec,
    design: Design,
    engines: Engines,
    step_requests: int,
    user_sd: float,
) -> Outcome:
    """One rollout, step by step, until promoted, rolled back, or holding."""
    population = Population.draw(rng, design.users, user_sd)
    per_unit = spec.settings.requests_per_unit
    outcome = Outcome("held")
    carried: dict[str, float] = {}
    for share in spec.settings.steps[:-1]:
        requests = min(step_requests, int(engines.stream_requests * 100 / (3 * share)))
        whole = draw_step(rng, design, population, share / 100, requests, engines, per_unit)
        step = _first_decision_of(spec, whole, carried, per_unit)
        traffic, n_c, log_e, decision = step
        end = decision.index if decision is not None else n_c.size - 1
        outcome.exposure += int(n_c[end]) if n_c.size else 0
        if decision is None or decision.kind == "hold":
            return outcome
        if decision.kind == "rollback":
            outcome.final = "rolled_back"
            return outcome
        outcome.advanced = True
        outcome.requests_per_step.append(int(traffic.position[decision.index]) + 1)
        if decision.kind == "promote":
            break
        for test in spec.of_role("guardrail"):
            carried[test.name] = carried.get(test.name, 0.0) + float(log_e[test.name][end])
    outcome.final = "promoted"
    return outcome


def _first_decision_of(
    spec: RolloutSpec, whole: StepTraffic, carried: dict[str, float], per_unit: int
) -> tuple[StepTraffic, np.ndarray, dict[str, np.ndarray], Decision | None]:
    """The step's first decision, computed on growing prefixes of its traffic (cheap when it
    comes early; the same as on the whole, since every statistic is causal)."""
    total = whole.candidate.size
    size = min(FIRST_PREFIX, total)
    while True:
        traffic = whole.prefix(size)
        log_e = step_log_e(spec, traffic, per_unit)
        n_c = np.cumsum(traffic.candidate)
        n_b = np.arange(1, n_c.size + 1) - n_c
        decision = first_decision(spec, n_b, n_c, log_e, carried=carried)
        failing = failing_index(traffic)
        if failing is not None and (decision is None or failing < decision.index):
            decision = Decision("rollback", "candidate_failing", failing)
        if decision is None and size == total and total:
            decision = Decision("hold", "max_step_s", total - 1)
        if decision is not None and decision.kind == "hold":
            decision = _rollback_while_holding(spec, n_b, n_c, log_e, carried, decision)
            if decision.kind == "hold" and size < total:
                size = min(2 * size, total)  # a later rollback may still come
                continue
        if decision is not None or size == total:
            return traffic, n_c, log_e, decision
        size = min(2 * size, total)


def failing_index(traffic: StepTraffic) -> int | None:
    """The first request after which the candidate's last `FAILING_AFTER` requests all failed
    (the controller's failing-arm rule). Its other half, the other rollout arms' last as many
    all succeeded, holds here from the start: the baseline (not simulated request by
    request) is a healthy engine taking most of the traffic."""
    error = traffic.values["error"][traffic.candidate] > 0
    if error.size < FAILING_AFTER:
        return None
    window = np.convolve(error.astype(int), np.ones(FAILING_AFTER, dtype=int))[: error.size]
    hit = np.flatnonzero(window == FAILING_AFTER)
    return int(np.flatnonzero(traffic.candidate)[hit[0]]) if hit.size else None


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
    if later is not None and later.kind == "rollback" and later.index >= hold.index:
        return later
    return Decision("hold", hold.reason, n_c.size - 1)


def step_aa(
    rng: np.random.Generator,
    spec: RolloutSpec,
    design: Design,
    share: float,
    engines: Engines,
    step_requests: int,
    user_sd: float,
) -> tuple[bool, bool]:
    """One A/A step at `share`, run to its end: (advanced, rolled back). A rollout's A/A
    rarely leaves its first step, so each step is checked here on its own, at its load."""
    population = Population.draw(rng, design.users, user_sd)
    per_unit = spec.settings.requests_per_unit
    # NOTE: no more requests than an engine's stream holds, so no arm reads its stream twice
    requests = min(step_requests, int(engines.stream_requests * 100 / (3 * share)))
    traffic = draw_step(rng, design, population, share / 100, requests, engines, per_unit)
    log_e = step_log_e(spec, traffic, per_unit)
    n_c = np.cumsum(traffic.candidate)
    n_b = np.arange(1, n_c.size + 1) - n_c
    advanced = first_decision(
        spec, n_b, n_c, {t.name: log_e[t.name] for t in spec.of_role("target")}
    )
    guards = {t.name: log_e[t.name] for t in spec.of_role("guardrail")}
    rolled_back = first_decision(spec, n_b, n_c, guards)
    return advanced is not None, rolled_back is not None


def step_rows(
    rng: np.random.Generator, spec: RolloutSpec, engines: Engines, args: argparse.Namespace
) -> list[str]:
    """A/A at each deciding step on its own: the false advance (the target's test reaching
    1/alpha once both arms have `min_requests`) and false rollback (a guardrail reaching k/alpha)
    anywhere in the step."""
    rows = [
        f"A/A, each deciding step on its own ({args.step_rollouts} steps each, of "
        f"{args.step_requests} requests or as many as an engine's stream of "
        f"{args.stream_requests} covers): false advance / false rollback",
        "",
        "| step | assignment / unit | users | false advance | false rollback |",
        "|---|---|---|---|---|",
    ]
    kinds = [Design("aa", users=u) for u in args.users]
    kinds.append(Design("aa", assignment="request", users=max(args.users)))
    for share in spec.settings.steps[:-1]:
        for design in kinds:
            results = np.asarray(
                [
                    step_aa(rng, spec, design, share, engines, args.step_requests, args.user_sd)
                    for _ in range(args.step_rollouts)
                ]
            )
            advance, rollback = results.mean(axis=0)
            rows.append(
                f"| {share:g}% | {design.assignment} / {design.unit_kind} | {design.users} | "
                f"{advance:.3f} | {rollback:.3f} |"
            )
    return rows


def bootstrap_aa(
    rng: np.random.Generator,
    spec: RolloutSpec,
    engines: Engines,
    requests: int,
    looks: int,
    resamples: int,
) -> tuple[bool, bool, bool, bool]:
    """One A/A step at 50/50 (per-request assignment): (bootstrap advance, bootstrap
    rollback, sequential advance, sequential rollback), the bootstrap verdict (`carousel ab
    report`'s) on p50 TTFT at `looks` looks, stopping at the first significant one."""
    design = Design("aa", topology="baseline", assignment="request", users=1000)
    population = Population.draw(rng, design.users, 0.0)
    traffic = draw_step(rng, design, population, 0.5, requests, engines)
    n_c = np.cumsum(traffic.candidate)
    n_b = np.arange(1, n_c.size + 1) - n_c
    decision = first_decision(
        spec, n_b, n_c, step_log_e(spec, traffic, spec.settings.requests_per_unit)
    )
    seq_advance = decision is not None and decision.kind in ("advance", "promote")
    seq_rollback = decision is not None and decision.kind == "rollback"
    spec_p50 = METRICS_BY_KEY["ttft_p50"]
    ttft = traffic.values["ttft_ms"]
    for look in np.linspace(n_c.size / looks, n_c.size, looks).astype(int):
        base, cand = ttft[:look][~traffic.candidate[:look]], ttft[:look][traffic.candidate[:look]]
        if min(base.size, cand.size) < spec.settings.min_requests:
            continue
        entry = compare_runs(
            "baseline", [_run_sample(base)], "candidate", [_run_sample(cand)],
            slo_active=False, rng=rng, num_resamples=resamples, paired=False,
            metrics=[spec_p50],
        )[0]  # fmt: skip
        if entry["significant"]:
            return bool(entry["better"]), not entry["better"], seq_advance, seq_rollback
    return False, False, seq_advance, seq_rollback


def _run_sample(ttft: np.ndarray) -> RunSample:
    nan = np.full(ttft.size, np.nan)
    empty = np.zeros(0)
    return RunSample(ttft, nan, nan, np.zeros(ttft.size), nan, empty, empty.astype(int), None)


def _median_p90(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{np.median(values):.0f} / {np.percentile(values, 90):.0f}"


def designs(args: argparse.Namespace) -> list[Design]:
    """The table's rows: every scenario at every user count in the documented topology,
    then the same per request, and A/A against the baseline's own engine (refused now)."""
    rows = [Design(s, users=u) for s in args.scenarios for u in args.users]
    rows += [Design(s, assignment="request", users=max(args.users)) for s in args.scenarios]
    rows += [Design("aa", topology="baseline", users=max(args.users))]
    return rows


def report(args: argparse.Namespace, spec: RolloutSpec) -> list[str]:
    """The table of rates and exposures (Markdown), one row per design."""
    rng = np.random.default_rng(args.seed)
    engines = Engines(args.rate, args.stream_requests, args.cache)
    rows = [
        "| scenario | topology | assignment / unit | users | rollouts | advanced | promoted | "
        "rolled back | held | rolled back of those exposed | requests to each step (median) | "
        "exposure at rollback (median / p90) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for design in designs(args):
        outcomes = [
            simulate_rollout(rng, spec, design, engines, args.step_requests, args.user_sd)
            for _ in range(args.rollouts)
        ]
        rows.append(_row(spec, design, outcomes))
    if args.step_rollouts:
        rows += ["", *step_rows(rng, spec, engines, args)]
    if args.bootstrap_rollouts:
        rows += ["", *bootstrap_rows(rng, spec, engines, args)]
    return rows


def _row(spec: RolloutSpec, design: Design, outcomes: list[Outcome]) -> str:
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
    exposed = [o.final == "rolled_back" for o in outcomes if o.exposure > 0]
    of_exposed = f"{np.mean(exposed):.3f}" if exposed else "-"
    unit = f"{design.assignment} / {design.unit_kind}"
    return (
        f"| {design.scenario} | {design.topology} | {unit} | {design.users} | {len(outcomes)} | "
        f"{advanced:.3f} | {share['promoted']:.3f} | {share['rolled_back']:.3f} | {held:.3f} | "
        f"{of_exposed} | {steps} | {exposure} |"
    )


def bootstrap_rows(
    rng: np.random.Generator, spec: RolloutSpec, engines: Engines, args: argparse.Namespace
) -> list[str]:
    results = np.asarray(
        [
            bootstrap_aa(
                rng, spec, engines, args.bootstrap_requests, args.bootstrap_looks, args.resamples
            )
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
    parser.add_argument("--users", type=int, nargs="+", default=[20, 100, 1000, 10000])
    parser.add_argument("--user-sd", type=float, default=0.3)
    parser.add_argument("--rate", type=float, default=8.0, help="all arms' requests per second")
    parser.add_argument("--step-requests", type=int, default=36_000)
    parser.add_argument("--stream-requests", type=int, default=8000)
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "carousel" / "rollout_sim",
        help="where the engines' simulated streams are kept between runs",
    )
    parser.add_argument("--requests-per-unit", type=int, default=5)
    parser.add_argument("--step-rollouts", type=int, default=1000)
    parser.add_argument("--bootstrap-rollouts", type=int, default=200)
    parser.add_argument("--bootstrap-requests", type=int, default=3000)
    parser.add_argument("--bootstrap-looks", type=int, default=30)
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    settings = DEFAULT_SETTINGS.model_copy(update={"requests_per_unit": args.requests_per_unit})
    spec = build_spec(settings)
    print("\n".join(report(args, spec)))
    print(f"\n({time.monotonic() - began:.1f} s, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
