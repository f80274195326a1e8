"""Identical greedy answers: the share of requests each arm answered exactly as the baseline.

Two arms that sample greedily (temperature 0) from the same prompts give the same answer when
their engines computed the same logits for it. Where they do not, an arm's numerics differ
(dtype, quantisation, kernels), or its answers depend on what else shared its steps (a serving
engine without a batch-invariant mode, docs/batch-invariance.md). A latency difference between
arms of one model whose answers were all identical came from scheduling alone; with fewer
identical, the arms also computed differently.

Only greedy requests whose prompt is the same for both arms are compared: every request the
bench generates (it always sends temperature 0), a replayed one whose body has temperature 0
and one choice, and in a multi-turn workload only the first turns (a later turn resends the
arm's own earlier answer). Without any, the entry says why the arms are not comparable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.client import RequestResult
from bench.runner import BenchResult, RunRecord, arm_name
from bench.workload import RequestSpec


def is_greedy(spec: RequestSpec, temperature: float = 0.0) -> bool:
    """Whether `spec` asks for one greedy answer (the bench's own requests do at the bench's
    `temperature` 0)."""
    if spec.body is None:
        return temperature == 0
    return spec.body.get("temperature") == 0 and spec.body.get("n", 1) == 1


def comparable_requests(
    specs: Sequence[RequestSpec], temperature: float = 0.0
) -> tuple[set[int], str | None]:
    """The request indices whose answers can be compared across arms, and why none can
    (`temperature`: the bench's own requests')."""
    greedy = {s.index for s in specs if is_greedy(s, temperature)}
    if not greedy:
        return greedy, "not comparable: no request asked for temperature 0"
    same_prompt = {i for i in greedy if specs[i].turn == 1}
    if not same_prompt:
        return same_prompt, "not comparable: every greedy request resends an earlier answer"
    return same_prompt, None


def identical_share(
    base: Sequence[RequestResult], arm: Sequence[RequestResult], indices: set[int]
) -> tuple[int, int]:
    """(identical, compared): requests of `indices` both runs answered, and how many alike."""
    answered = {r.index: r.text for r in base if r.success and r.index in indices}
    pairs = [(answered[r.index], r.text) for r in arm if r.success and r.index in answered]
    return sum(a == b for a, b in pairs), len(pairs)


def answer_agreement(
    result: BenchResult,
    arms: list[str | None],
    specs: Sequence[RequestSpec],
    first_repeat_only: bool = False,
    temperature: float = 0.0,
) -> list[dict[str, Any]]:
    """Per rate and arm: how many greedy answers equal the baseline's (`arms[0]`), repeat by
    repeat (both arms of a repeat ran the same workload); `first_repeat_only` where later
    repeats' workloads differ in which requests are first turns (multi-turn)."""
    if len(arms) < 2:
        return []
    indices, reason = comparable_requests(specs, temperature)
    names = [arm_name(a) for a in arms]
    entries = []
    for rate in dict.fromkeys(run.rate for run in result.runs):
        runs = [r for r in result.runs if r.rate == rate]
        runs = [r for r in runs if r.repeat == 0 or not first_repeat_only]
        base = {r.repeat: r for r in runs if r.arm == names[0]}
        for name in names[1:]:
            pairs = [(base[r.repeat], r) for r in runs if r.arm == name and r.repeat in base]
            entry = {"rate": rate, "arm": name, "baseline": names[0], "not_comparable": reason}
            entries.append({**entry, **_counted(pairs, indices)})
    return entries


def _counted(pairs: list[tuple[RunRecord, RunRecord]], indices: set[int]) -> dict[str, Any]:
    counts = [identical_share(b.results, a.results, indices) for b, a in pairs]
    identical, compared = sum(c[0] for c in counts), sum(c[1] for c in counts)
    share = identical / compared if compared else None
    return {"identical": identical, "compared": compared, "share": share}


def agreement_sentence(entry: dict[str, Any]) -> str:
    """One line: the share of identical greedy answers, or why there is none."""
    arm, base = entry["arm"], entry["baseline"]
    if entry["not_comparable"] is not None:
        return f"greedy answers of {arm} and {base}: {entry['not_comparable']}"
    if not entry["compared"]:
        return f"greedy answers of {arm} and {base}: not comparable: no request both answered"
    share = f"{entry['identical']}/{entry['compared']} ({entry['share']:.0%})"
    if entry["identical"] == entry["compared"]:
        why = "their latency differences came from scheduling alone"
    else:
        why = "the arms also computed differently (numerics, or answers that depend on the batch)"
    return f"greedy answers of {arm} identical to {base}'s on {share} of requests: {why}"
