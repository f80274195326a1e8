"""The rollout's metrics are one table: the settings, the tests they imply, the samples a
request gives and the docs all follow from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.rollout.evidence import request_sample
from gateway.rollout.spec import build_spec
from gateway.settings.rollout import RolloutSettings
from gateway.settings.rollout_metrics import (
    GUARDRAIL_METRICS,
    METRICS,
    SAMPLE_FIELDS,
    TARGET_METRICS,
    docs_table,
)

ROOT = Path(__file__).resolve().parent.parent


def _settings(**fields: object) -> RolloutSettings:
    return RolloutSettings(baseline="a", candidate="b", **fields)  # type: ignore[arg-type]


def test_the_docs_list_the_metrics_table() -> None:
    assert docs_table() in (ROOT / "docs" / "rollout.md").read_text()


@pytest.mark.parametrize("name", TARGET_METRICS)
def test_every_target_metric_is_accepted_and_tests_its_own_field(name: str) -> None:
    metric = next(m for m in METRICS if m.name == name)
    spec = build_spec(_settings(metric=name, guardrails={}))
    assert spec.of_role("target")[0].field == metric.field
    assert [t.name for t in spec.of_role("guardrail")] == [f"regression_{name}"]


@pytest.mark.parametrize("name", GUARDRAIL_METRICS)
def test_every_guardrail_metric_is_accepted_and_tests_its_own_field(name: str) -> None:
    metric = next(m for m in METRICS if m.name == name)
    spec = build_spec(_settings(guardrails={name: 0.1}))
    guardrail = next(t for t in spec.tests if t.name == f"guardrail_{name}")
    assert guardrail.field == metric.field
    assert guardrail.kind == ("tail" if metric.kind == "tail" else "paired")


def test_names_outside_the_table_are_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValidationError, match="unknown metric 'ttft_p90'; valid: ttft_p50"):
        _settings(metric="ttft_p90")
    with pytest.raises(ValidationError, match="unknown guardrail"):
        _settings(guardrails={"goodput": 0.1})


def test_the_earlier_goodput_target_is_read_as_the_error_rate() -> None:
    old, new = _settings(metric="goodput"), _settings(metric="error_rate")
    assert old.metric == "error_rate"
    assert build_spec(old) == build_spec(new)


def test_a_finished_request_gives_every_field_the_metrics_read() -> None:
    sample = request_sample(200, ttft_s=0.1, total_s=0.5, completion_tokens=5)
    assert set(sample) == set(SAMPLE_FIELDS)
