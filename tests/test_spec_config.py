"""`--speculative-config` reads vLLM's spelling, applies its defaults, and refuses clearly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schedulers.spec_decode.config import (
    ADAPTIVE_MAX_CONCURRENCY,
    DEFAULT_PROMPT_LOOKUP,
    MAX_SPEC_LEN,
    SpeculativeConfig,
    parse_speculative_config,
)


def parse(**fields: Any) -> SpeculativeConfig:
    config = parse_speculative_config(json.dumps(fields))
    assert config is not None
    return config


def test_vllms_spelling_round_trips() -> None:
    config = parse(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=6
    )
    assert config == SpeculativeConfig(4, "ngram", 2, 6)
    assert not config.adaptive and config.max_concurrency is None


@pytest.mark.parametrize("value", [None, "", "  ", "null"])
def test_nothing_given_means_speculation_off(value: str | None) -> None:
    assert parse_speculative_config(value) is None


def test_a_yaml_mapping_is_read_like_the_json() -> None:
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == (
        SpeculativeConfig(3)
    )


@pytest.mark.parametrize(
    ("given", "window"),
    [
        ({}, (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)),  # vLLM: both 5
        ({"prompt_lookup_max": 3}, (3, 3)),  # the missing bound equals the other
        ({"prompt_lookup_min": 7}, (7, 7)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
    ],
)
def test_prompt_lookup_defaults_mirror_vllm(given: dict[str, int], window: tuple[int, int]) -> None:
    config = parse(method="ngram", num_speculative_tokens=2, **given)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == window


@pytest.mark.parametrize(
    "spelling", [{"method": "[ngram]"}, {"model": "ngram"}, {"model": "[ngram]"}]
)
def test_vllms_other_ngram_spellings_are_the_ngram_method(spelling: dict[str, str]) -> None:
    assert parse(num_speculative_tokens=2, **spelling).method == "ngram"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "lookahead"}, "unknown speculative method 'lookahead'; supported: ngram"),
        ({"method": "eagle3"}, "method 'eagle3' needs a draft model"),
        ({"model": "meta-llama/Llama-3.2-1B"}, "a draft model is not supported"),
        ({"method": None}, "needs a method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 32], got 0"),
        ({"num_speculative_tokens": MAX_SPEC_LEN + 1}, "must be in [1, 32], got 33"),
        ({"prompt_lookup_min": 0, "prompt_lookup_max": 3}, "prompt_lookup_min must be at least 1"),
        (
            {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ({"num_speculative_tokens": "4"}, 'num_speculative_tokens must be an integer, got "4"'),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer, got 2.0"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer, got true"),
        ({"adaptive": 1}, "adaptive must be true or false, got 1"),
        ({"prompt_lookup_minimum": 2}, "unknown key(s) 'prompt_lookup_minimum'"),
        (
            {"ema_alpha": 0.5},
            "ema_alpha: the adaptive policy's knobs",
        ),
        ({"adaptive": True, "ema_alpha": 0.0}, "ema_alpha must be in (0, 1]"),
        ({"adaptive": True, "down_hysteresis": 0.2, "up_hysteresis": 0.1}, "k bounces"),
        ({"adaptive": True, "down_hysteresis": -0.5}, "k never falls to 0"),
        ({"adaptive": True, "up_hysteresis": 0.5}, "k never rises"),
        ({"adaptive": True, "probe_backoff_steps": 0}, "probe_backoff_steps must be at least 1"),
        (
            {"adaptive": True, "probe_backoff_steps": 8, "max_probe_backoff_steps": 4},
            "max_probe_backoff_steps=4 must be >= probe_backoff_steps=8",
        ),
        ({"max_concurrency": 0}, "max_concurrency must be at least 1"),
        ({"max_concurrency": 2, "concurrency_hysteresis": 2}, "drafting never resumes"),
        ({"min_switch_steps": 0}, "min_switch_steps must be at least 1"),
    ],
)
def test_bad_values_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    given = {"method": "ngram", "num_speculative_tokens": 4} | fields
    with pytest.raises(ValueError) as caught:
        parse_speculative_config(json.dumps(given))
    assert message in str(caught.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        SpeculativeConfig(0, prompt_lookup_min=3, prompt_lookup_max=2)
    assert "num_speculative_tokens" in str(caught.value)
    assert "prompt_lookup_min=3 must be <= prompt_lookup_max=2" in str(caught.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ],
)
def test_malformed_input_is_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)


def test_the_adaptive_knobs_are_read_when_adaptive() -> None:
    config = parse(
        method="ngram",
        num_speculative_tokens=4,
        adaptive=True,
        ema_alpha=0.5,
        up_hysteresis=0.1,
        down_hysteresis=-0.1,
        probe_backoff_steps=4,
        max_probe_backoff_steps=64,
        max_concurrency=8,
        concurrency_hysteresis=3,
        min_switch_steps=2,
    )
    assert config.adaptive and config.ema_alpha == 0.5 and config.max_concurrency == 8
    assert (config.probe_backoff_steps, config.max_probe_backoff_steps) == (4, 64)


def test_the_adaptive_policy_defaults_to_the_measured_load_threshold() -> None:
    """vLLM drafts at any load (no threshold); the adaptive form takes the one measured
    (scripts/spec_thresholds.py) unless the config names one, null included."""
    adaptive = parse(method="ngram", num_speculative_tokens=4, adaptive=True)
    assert adaptive.max_concurrency == ADAPTIVE_MAX_CONCURRENCY
    assert parse(method="ngram", num_speculative_tokens=4).max_concurrency is None
    unlimited = parse(method="ngram", num_speculative_tokens=4, adaptive=True, max_concurrency=None)
    assert unlimited.max_concurrency is None
