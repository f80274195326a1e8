"""The bench's per-request mixes: `--users` (the body's `user`), `--deadline-mix` (the
deadline header, and goodput held to each request's own deadline), `--verdict-user`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.client import DEADLINE_HEADER, ClientConfig, RequestResult, build_body, build_headers
from bench.metrics import Slo, meets_slo
from bench.workload import (
    RequestSpec,
    assign_mix,
    parse_deadline_mix,
    parse_mix,
)
from tests.test_bench_live import FakeOptions, bench_args, fake_server

CFG = ClientConfig(api_base="http://127.0.0.1:1/v1", model="m")


def test_a_mix_is_normalised_to_shares() -> None:
    assert parse_mix("heavy:9,light:1") == [("heavy", 0.9), ("light", 0.1)]
    for bad in ("heavy", "heavy:0", ":1", ""):
        with pytest.raises(ValueError):
            parse_mix(bad)
    with pytest.raises(ValueError):
        parse_deadline_mix("-5:1")


def test_requests_get_users_and_deadlines_by_share_and_seed() -> None:
    specs = [RequestSpec(i, 4, "hi") for i in range(2000)]
    users = parse_mix("heavy:9,light:1")
    deadlines = parse_deadline_mix("300:1,5000:3")
    mixed = assign_mix(specs, 7, users, deadlines)
    light = sum(s.user == "light" for s in mixed) / len(mixed)
    tight = sum(s.deadline_ms == 300.0 for s in mixed) / len(mixed)
    assert 0.07 < light < 0.13 and 0.2 < tight < 0.3
    assert mixed == assign_mix(specs, 7, users, deadlines)
    assert mixed != assign_mix(specs, 8, users, deadlines)


def test_the_user_goes_in_the_body_and_the_deadline_in_a_header() -> None:
    spec = RequestSpec(0, 4, "hi", user="light", deadline_ms=250.0)
    assert build_body(CFG, spec)["user"] == "light"
    assert "user" not in build_body(CFG, RequestSpec(0, 4, "hi"))
    assert build_headers(CFG, None, spec.deadline_ms)[DEADLINE_HEADER] == "250"
    assert DEADLINE_HEADER not in build_headers(CFG, None)


def test_a_requests_own_deadline_replaces_the_ttft_objective() -> None:
    slo = Slo(ttft_ms=1000)
    done = RequestResult(0, 4, ttft=0.5, latency=0.6, success=True, deadline_ms=300)
    assert not meets_slo(done, slo)
    done.deadline_ms = 800
    assert meets_slo(done, slo)
    done.deadline_ms = None
    assert meets_slo(done, slo)


def test_verdict_user_compares_only_that_users_requests(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with fake_server(FakeOptions(step_s=0.002)) as (url, seen):
        argv = bench_args(url, out, "--arm", "a", "--arm", "b", "--num-requests", "40",
                          "--users", "heavy:3,light:1", "--verdict-user", "light",
                          "--resamples", "100")  # fmt: skip
        assert main(argv) == 0
    users = [s["body"]["user"] for s in seen]
    lines = [json.loads(line) for line in (out / "requests.jsonl").open()]
    light = sum(line["user"] == "light" for line in lines if line["arm"] == "a")
    assert set(users) == {"heavy", "light"} and 0 < light < 20
    report = json.loads((out / "report.json").read_text())
    ttft = next(e for e in report["comparison"] if e["metric"] == "ttft_p50")
    assert ttft["n_baseline"] == ttft["n_arm"] == light
