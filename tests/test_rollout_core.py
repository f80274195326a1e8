"""The rollout's decision core: anytime-valid tests, the shared tally, the decision rule."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.rollout.betting import MeanTest, log_e_value
from gateway.rollout.decision import decide
from gateway.rollout.evidence import (
    BLOCK_PER_UNIT,
    StepObserver,
    TailReference,
    Tally,
    request_sample,
    tail_thresholds,
)
from gateway.rollout.spec import build_spec
from gateway.settings.rollout import RolloutSettings

#: one request a unit: these tests check the tests' mechanics request by request
SETTINGS = RolloutSettings(
    baseline="orca",
    candidate="sjf",
    guardrails={"error_rate": 0.005, "ttft_p99": 0.10, "tpot_p50": 0.10},
    min_requests=100,
    requests_per_unit=1,
)


def crossing_rate(test: MeanTest, samples: np.ndarray, alpha: float) -> float:
    """The share of streams (rows) whose e-value ever reaches 1/alpha, looked at every sample."""
    crossed = 0
    for row in samples:
        log_e = log_e_value(np.cumsum(test.increments(row), axis=0))
        crossed += bool((log_e >= np.log(1 / alpha)).any())
    return crossed / len(samples)


def test_a_true_null_is_rejected_at_most_alpha_of_the_time_looking_after_every_sample() -> None:
    rng = np.random.default_rng(1)
    samples = (rng.random((1000, 2000)) < 0.5).astype(float)  # E[X] = 0.5, the null's edge
    assert crossing_rate(MeanTest(0.5, 0.0), samples, alpha=0.05) <= 0.05


def test_a_mean_above_the_null_is_found() -> None:
    rng = np.random.default_rng(2)
    samples = (rng.random((200, 2000)) < 0.6).astype(float)
    assert crossing_rate(MeanTest(0.5, 0.0), samples, alpha=0.05) >= 0.95


def test_a_bet_never_goes_below_zero_wealth_at_the_lower_bound() -> None:
    increments = MeanTest(0.005, -1.0).increments(np.asarray([-1.0, 1.0]))
    assert np.isfinite(increments).all()


def test_tallies_add_in_any_order_and_survive_json() -> None:
    test = MeanTest(0.5, 0.0)
    parts = [Tally(), Tally()]
    parts[0].add_increments("target", test.increments(np.asarray([1.0, 1.0, 0.0])))
    parts[1].add_increments("target", test.increments(np.asarray([0.0, 1.0])))
    parts[1].requests["candidate"] += 2
    one, other = Tally(), Tally()
    one.merge(parts[0])
    one.merge(parts[1])
    other.merge(Tally.from_json(parts[1].to_json()))
    other.merge(Tally.from_json(parts[0].to_json()))
    whole = Tally()
    whole.add_increments("target", test.increments(np.asarray([1.0, 1.0, 0.0, 0.0, 1.0])))
    assert one.n == other.n == {"target": 5}
    assert one.log_e("target") == pytest.approx(other.log_e("target"))
    assert one.log_e("target") == pytest.approx(whole.log_e("target"))
    assert one.requests == {"reference": 0, "candidate": 2}


def test_the_running_tail_reference_matches_its_vectorised_rule() -> None:
    values = np.random.default_rng(3).lognormal(0, 1, 3000)
    reference = TailReference()
    seen = []
    for value in values:
        reference.add(float(value))
        seen.append(np.nan if reference.threshold is None else reference.threshold)
    np.testing.assert_allclose(np.asarray(seen), tail_thresholds(values))


def observe(observer: StepObserver, arm: str, samples: list[dict[str, float]]) -> Tally:
    tally = Tally()
    for sample in samples:
        tally.merge(observer.observe(arm, sample))
    return tally


def test_a_slower_candidate_grows_the_tpot_guardrail_and_not_the_target() -> None:
    spec = build_spec(SETTINGS)
    observer = StepObserver(spec)
    rng = np.random.default_rng(4)
    tally = Tally()
    for _ in range(300):
        base = float(rng.lognormal(3, 0.3))
        tally.merge(observer.observe("reference", {"ttft_ms": 100.0, "tpot_ms": base}))
        cand = {"ttft_ms": 100.0, "tpot_ms": base * 1.5, "error": 0.0}
        tally.merge(observer.observe("candidate", cand))
    assert tally.requests == {"reference": 300, "candidate": 300}
    assert tally.log_e("guardrail_tpot_p50") > spec.log_threshold("guardrail")
    assert tally.log_e("target") < spec.log_threshold("target")


def test_failed_requests_count_for_the_error_guardrail_only() -> None:
    spec = build_spec(SETTINGS)
    observer = StepObserver(spec)
    tally = Tally()
    for _ in range(200):
        tally.merge(observer.observe("reference", {"ttft_ms": 100.0, "error": 0.0}))
        tally.merge(observer.observe("candidate", {"error": 1.0}))
    assert tally.n["guardrail_error_rate"] == min(tally.units.values()) > 100
    assert "target" not in tally.n
    assert tally.log_e("guardrail_error_rate") > spec.log_threshold("guardrail")


SPEC = build_spec(SETTINGS)


def test_a_breached_guardrail_rolls_back_before_min_requests() -> None:
    decision = decide(SPEC, 5, 5, {"guardrail_ttft_p99": 10.0, "target": 10.0}, 1.0)
    assert decision is not None and decision.kind == "rollback"
    assert decision.reason == "guardrail_ttft_p99"


def test_a_guardrail_carried_from_earlier_steps_counts() -> None:
    level = SPEC.log_threshold("guardrail")
    assert decide(SPEC, 500, 500, {"guardrail_error_rate": level / 2}, 1.0) is None
    carried = {"guardrail_error_rate": level / 2 + 0.01}
    decision = decide(SPEC, 500, 500, {"guardrail_error_rate": level / 2}, 1.0, carried)
    assert decision is not None and decision.kind == "rollback"


def test_a_better_target_advances_only_with_min_requests_per_arm() -> None:
    assert decide(SPEC, 500, 99, {"target": 10.0}, 1.0) is None
    decision = decide(SPEC, 500, 100, {"target": 10.0}, 1.0)
    assert decision is not None and decision.kind == "advance"


@pytest.mark.parametrize("on_no_difference", ["hold", "promote"])
def test_no_difference_does_what_the_settings_say(on_no_difference: str) -> None:
    settings = SETTINGS.model_copy(update={"on_no_difference": on_no_difference})
    both = {"equivalent_high": 4.0, "equivalent_low": 4.0}
    decision = decide(build_spec(settings), 200, 200, both, 1.0)
    assert decision is not None and decision.kind == on_no_difference
    assert decide(build_spec(settings), 200, 200, {"equivalent_high": 4.0}, 1.0) is None


def test_a_step_past_max_step_s_holds() -> None:
    assert decide(SPEC, 200, 200, {}, 3599.0) is None
    decision = decide(SPEC, 200, 200, {}, 3600.0)
    assert decision is not None and (decision.kind, decision.reason) == ("hold", "max_step_s")


def test_settings_refuse_what_no_rollout_can_run() -> None:
    with pytest.raises(ValueError, match="last step must be 100"):
        RolloutSettings(baseline="a", candidate="b", steps=[5, 50])
    with pytest.raises(ValueError, match="unknown guardrail"):
        RolloutSettings(baseline="a", candidate="b", guardrails={"latency": 0.1})
    with pytest.raises(ValueError, match="different arms"):
        RolloutSettings(baseline="a", candidate="a")


def test_arm_refusals_and_failures_are_errors_and_client_mistakes_count_for_nothing() -> None:
    for status in (429, 500, 502, 503, 504):
        assert request_sample(status, None, 1.0, 0) == {"error": 1.0}
    for status in (400, 401, 403, 404, 413, 422, 499):
        assert request_sample(status, None, 1.0, 0) == {}
    assert request_sample(200, 0.1, 1.1, 11) == pytest.approx(
        {"error": 0.0, "e2e_ms": 1100.0, "ttft_ms": 100.0, "tpot_ms": 100.0}
    )


def test_a_user_is_one_sample_per_step_however_many_requests_it_sends() -> None:
    settings = SETTINGS.model_copy(update={"requests_per_unit": 3})
    observer = StepObserver(build_spec(settings))
    tally = Tally()
    for i in range(10):  # one heavy user: its first three requests are its one sample
        tally.merge(observer.observe("candidate", {"ttft_ms": 100.0 * (i + 1), "error": 0.0}, "u"))
    tally.merge(observer.observe("reference", {"ttft_ms": 150.0, "error": 0.0}, "v"))
    tally.merge(observer.observe("reference", {"ttft_ms": 150.0, "error": 0.0}, "w"))
    assert tally.requests == {"reference": 2, "candidate": 10}
    assert tally.units == {"reference": 0, "candidate": 1}
    for user in ("v", "w"):
        tally.merge(observer.observe("reference", {"ttft_ms": 150.0, "error": 0.0}, user))
        tally.merge(observer.observe("reference", {"ttft_ms": 150.0, "error": 0.0}, user))
    assert tally.units == {"reference": 2, "candidate": 1}
    # one pair: the user's geometric mean (100 * 6^(1/3) = 182 ms) against 150 ms: worse
    assert tally.n["target"] == 1
    assert tally.log_e("target") < 0


def test_a_candidate_worse_on_the_target_itself_is_rolled_back() -> None:
    settings = SETTINGS.model_copy(update={"guardrails": {"error_rate": 0.005}})
    spec = build_spec(settings)
    assert [t.name for t in spec.of_role("guardrail")] == [
        "guardrail_error_rate",
        "regression_ttft_p50",
    ]
    observer = StepObserver(spec)
    rng = np.random.default_rng(5)
    tally = Tally()
    for _ in range(400):
        base = float(rng.lognormal(5, 0.5))
        tally.merge(observer.observe("reference", {"ttft_ms": base, "error": 0.0}))
        tally.merge(observer.observe("candidate", {"ttft_ms": base * 2, "error": 0.0}))
    log_e = {t.name: tally.log_e(t.name) for t in spec.tests}
    decision = decide(spec, 400, 400, log_e, 1.0)
    assert decision is not None and decision.kind == "rollback"
    assert decision.reason == "regression_ttft_p50"


def test_requests_without_a_user_form_blocks_with_one_sample_an_arm_each() -> None:
    settings = SETTINGS.model_copy(update={"requests_per_unit": 2})
    observer = StepObserver(build_spec(settings))
    tally = Tally()
    size = BLOCK_PER_UNIT * 2  # a block: 6 requests of both arms
    arms = ["reference", "candidate"] * (5 * size // 2)  # 5 blocks, 3 requests an arm each
    for i, arm in enumerate(arms):
        tally.merge(observer.observe(arm, {"ttft_ms": 100.0 + i, "error": 0.0}))  # type: ignore[arg-type]
    # each block gives each arm one sample, its first 2 requests there; the third counts in n
    assert tally.units == {"reference": 5, "candidate": 5}
    assert tally.requests == {"reference": 15, "candidate": 15}
    assert tally.n["target"] == 5
