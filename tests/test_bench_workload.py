"""Bench workloads: DIST parsing, presets, arrivals, synthetic prompts, JSONL datasets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.workload import (
    WORDS,
    arrival_offsets,
    build_workload,
    load_dataset,
    parse_dist,
    parse_rate,
    parse_rates,
)


def sample(spec: str, kind: str = "output", n: int = 2000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(parse_dist(spec, kind).sample(rng, n))  # type: ignore[arg-type]


def test_fixed_and_bare_number_are_constant() -> None:
    assert set(sample("fixed:128", n=50)) == {128}
    assert set(sample("7", n=50)) == {7}


def test_uniform_covers_both_ends_inclusive() -> None:
    values = sample("uniform:3:6")
    assert set(values) == {3, 4, 5, 6}


def test_lognormal_has_the_median_and_respects_the_cap() -> None:
    values = sample("lognormal:48:1.0:256", n=20000)
    assert abs(np.median(values) - 48) <= 3
    assert values.max() == 256 and values.min() >= 1
    assert sample("lognormal:100:0").tolist() == [100] * 2000


@pytest.mark.parametrize(
    "bad",
    ["", "fixed", "fixed:0", "uniform:9:3", "uniform:1", "lognormal:48", "lognormal:48:-1",
     "poisson:3", "uniform:a:b", "heavy"],
)  # fmt: skip
def test_bad_dists_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_dist(bad, "input")


def test_orca_preset_ranges() -> None:
    inputs = sample("orca", "input", n=5000)
    outputs = sample("orca", "output", n=5000)
    assert inputs.min() >= 32 and inputs.max() <= 512 and inputs.max() - inputs.min() > 400
    assert outputs.min() >= 1 and outputs.max() <= 128 and outputs.max() - outputs.min() > 100
    assert str(parse_dist("orca", "input")) == "orca"


def test_heavy_tail_preset_is_capped_lognormal_with_median_near_48() -> None:
    outputs = sample("heavy-tail", "output", n=20000)
    assert abs(np.median(outputs) - 48) <= 3
    assert outputs.max() == 256
    assert np.mean(outputs > 2 * 48) > 0.15  # a real tail, unlike uniform:1:128


def test_same_seed_same_workload_and_different_seed_differs() -> None:
    dist_in, dist_out = parse_dist("orca", "input"), parse_dist("orca", "output")
    a = build_workload(20, dist_in, dist_out, seed=3)
    b = build_workload(20, dist_in, dist_out, seed=3)
    c = build_workload(20, dist_in, dist_out, seed=4)
    assert a == b
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert arrival_offsets(20, 2.0, 1.0, 3) == arrival_offsets(20, 2.0, 1.0, 3)
    assert arrival_offsets(20, 2.0, 1.0, 3) != arrival_offsets(20, 2.0, 1.0, 4)


def test_synthetic_prompts_have_one_word_per_target_token() -> None:
    specs = build_workload(5, parse_dist("uniform:10:40", "input"), parse_dist("4", "output"), 0)
    for spec in specs:
        words = (spec.prompt or "").split()
        assert len(words) == spec.target_input_len
        assert set(words) <= set(WORDS)
        assert spec.max_tokens == 4
    assert len({s.prompt for s in specs}) == 5


def test_poisson_mean_gap_is_one_over_rate() -> None:
    offsets = arrival_offsets(20001, rate=4.0, burstiness=1.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_mean_and_sets_cv(burstiness: float) -> None:
    gaps = np.diff(arrival_offsets(20001, rate=2.0, burstiness=burstiness, seed=1))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_infinite_rate_is_one_burst() -> None:
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5


def test_rate_parsing() -> None:
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    assert parse_rates("1, 2,4,inf") == [1.0, 2.0, 4.0, math.inf]
    for bad in ("0", "-1", "nan", "fast"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_jsonl_dataset_loads_prompts_messages_and_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 7},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"}]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    dataset = load_dataset(path)
    specs = build_workload(3, parse_dist("8", "input"), parse_dist("5", "output"), 0, dataset)
    assert [s.max_tokens for s in specs] == [7, 5, 7]  # cycled; no max_tokens -> --output-len
    assert specs[0].as_messages() == [{"role": "user", "content": "hello there"}]
    assert specs[1].as_messages()[0]["role"] == "system"
    assert specs[1].as_prompt() == "be brief\nhi"
    assert specs[2].prompt == "hello there" and specs[2].target_input_len is None


@pytest.mark.parametrize(
    "line",
    ['"just a string"', '{"prompt": 3}', '{"messages": []}', '{"prompt": "a", "messages": []}',
     '{"prompt": "a", "max_tokens": 0}', "{not json", "{}"],
)  # fmt: skip
def test_bad_dataset_lines_name_the_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_dataset(path)
