"""Whether a live split compared its arms at equal load (`carousel ab report`).

A batching policy's latency is a function of the load on its engine, and in a live split the
weights set that load: an arm with weight w over e engines gives each engine w / e of the
traffic. Two arms compared at unequal loads per engine differ by their loads as much as by
their policies (two identical engines at 10/90 differ), so the verdict of such a pair is
reported as confounded, naming the fix. An arm's engines are read from `carousel_arm_info`:
one per URL of an upstream arm's group, one for a local arm.

The check: the pair is confounded when the arms have different numbers of engines (a pool
spreads concurrent requests over its engines where one engine batches them, so equal average
loads are not carried alike: gateway/settings/rollout_topology.py), or when one's engines
served more than `LOAD_RATIO` times the other's and a binomial test of the split against
equal per-engine load rejects at `LOAD_ALPHA` (so a 50/50 split's sampling noise is never
called confounded).
"""

from __future__ import annotations

from typing import Any

from scipy.stats import binomtest

#: per-engine loads further apart than this (and significantly so) are unequal
LOAD_RATIO = 1.2
LOAD_ALPHA = 0.01


def engines_of(info: list[dict[str, str]], model: str, arm: str) -> int | None:
    """How many engines serve `arm`: its upstream group's URLs, 1 for a local arm (None:
    not exported)."""
    for entry in info:
        if entry["model"] == model and entry["arm"] == arm:
            group = entry["device_group"]
            if group.startswith("upstream:"):
                return len(group.removeprefix("upstream:").split(","))
            return 1
    return None


def load_entry(
    base: str, arm: str, requests: dict[str, int], engines: dict[str, int | None]
) -> dict[str, Any]:
    """The load entry of one compared pair: `confounded` True, False or None (unknown)."""
    entry: dict[str, Any] = {"baseline": base, "arm": arm, "confounded": None}
    n_base, n_arm = requests.get(base, 0), requests.get(arm, 0)
    e_base, e_arm = engines.get(base), engines.get(arm)
    if e_base is None or e_arm is None or not n_base or not n_arm:
        entry["text"] = f"unknown whether {base} and {arm} carried equal loads per engine"
        return entry
    per_base, per_arm = n_base / e_base, n_arm / e_arm
    ratio = max(per_base, per_arm) / min(per_base, per_arm)
    expected = e_arm / (e_base + e_arm)  # the arm's share of requests under equal loads
    p_value = binomtest(n_arm, n_base + n_arm, expected).pvalue
    entry.update(per_engine={base: per_base, arm: per_arm}, ratio=ratio, p_value=p_value)
    loads = (
        f"each engine of {base} served {per_base:.0f} requests ({e_base} engine(s)) and each "
        f"of {arm} {per_arm:.0f} ({e_arm})"
    )
    if e_base != e_arm:
        entry["confounded"] = True
        entry["text"] = (
            f"CONFOUNDED by load: {loads}: pools of different sizes carry a load differently "
            "(one engine batches what a pool spreads). Compare arms of as many engines each "
            "(a control arm of the baseline's config beside the candidate: docs/rollout.md)"
        )
    elif ratio > LOAD_RATIO and p_value < LOAD_ALPHA:
        entry["confounded"] = True
        entry["text"] = (
            f"CONFOUNDED by load: {loads}, {ratio:.2g}x apart, so each arm's latency reflects "
            "its load as much as its policy. Compare at equal load: equal weights, or a "
            "control arm of the baseline's config at the candidate's share, compared with it "
            "(`--arm control --arm candidate`; docs/rollout.md)"
        )
    else:
        entry["confounded"] = False
        entry["text"] = f"equal loads per engine: {loads}"
    return entry
