"""`carousel bench --replay` on public traces: each format read with its exact lengths and
times, prompts synthesised to the server's own token count, Mooncake's shared blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.cli import main
from bench.exact_prompts import MOONCAKE_BLOCK_TOKENS, PromptCost, block_prompt, exact_prompt
from bench.fake_server import fake_server
from bench.public_traces import TraceRequest, detect_format, load_trace
from bench.trace_replay import select_rows
from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, serve_app, sim_arm

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.9000000,396,109
2023-11-16 18:15:47.2805900,879,20
2023-11-16 18:15:48.1805900,91,7
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
46.5,GPT-4,417,173,590,API log
"""
MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 30, "output_length": 9, "hash_ids": [4]},
]
SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "What is paged attention?"},
        {"from": "gpt", "value": "A way to store the KV cache in blocks."},
    ]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "no question first"}]},
    {"id": "c", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
    ]},
]  # fmt: skip


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def traces(tmp_path: Path) -> dict[str, Path]:
    return {
        "azure": write(tmp_path / "azure.csv", AZURE),
        "burstgpt": write(tmp_path / "burst.csv", BURSTGPT),
        "mooncake": write(tmp_path / "mc.jsonl", "".join(json.dumps(r) + "\n" for r in MOONCAKE)),
        "sharegpt": write(tmp_path / "sg.json", json.dumps(SHAREGPT)),
    }


def test_each_format_is_recognised_by_its_content(traces: dict[str, Path], tmp_path: Path) -> None:
    for fmt, path in traces.items():
        assert detect_format(path) == fmt
    record = write(tmp_path / "rec.jsonl", json.dumps({"t": 0, "body": {}}) + "\n")
    assert detect_format(record) == "carousel"
    with pytest.raises(ValueError, match="--replay-format"):
        detect_format(write(tmp_path / "x.csv", "a,b\n1,2\n"))


def test_azure_rows_keep_their_lengths_and_times(traces: dict[str, Path]) -> None:
    rows = load_trace(traces["azure"], "azure")
    assert [(r.input_len, r.output_len) for r in rows] == [
        (374, 44),
        (396, 109),
        (879, 20),
        (91, 7),
    ]
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.21941, 0.6, 1.5])


def test_burstgpt_rows_keep_failures_as_one_token(traces: dict[str, Path]) -> None:
    rows = load_trace(traces["burstgpt"], "burstgpt")
    assert [(r.arrival_s, r.input_len, r.output_len) for r in rows] == [
        (0.0, 472, 18), (40.0, 1087, 1), (41.5, 417, 173)
    ]  # fmt: skip


def test_mooncake_rows_have_ms_times_and_block_ids(traces: dict[str, Path]) -> None:
    rows = load_trace(traces["mooncake"], "mooncake")
    assert [r.arrival_s for r in rows] == [0.0, 0.25, 1.5]
    assert [(r.input_len, r.output_len, r.hash_ids) for r in rows] == [
        (1100, 5, (0, 1, 2)), (700, 3, (0, 3)), (30, 9, (4,))
    ]  # fmt: skip


def test_sharegpt_rows_carry_the_first_question(traces: dict[str, Path]) -> None:
    rows = load_trace(traces["sharegpt"], "sharegpt")
    assert [(r.prompt, r.output_len, r.arrival_s) for r in rows] == [
        ("What is paged attention?", 9, None), ("Hi", 1, None)
    ]  # fmt: skip


def test_a_bad_row_is_named(tmp_path: Path) -> None:
    bad = write(tmp_path / "a.csv", AZURE + "2023-11-16 18:15:49,many,3\n")
    with pytest.raises(ValueError, match=r"a\.csv:6: not a azure trace row"):
        load_trace(bad, "azure")


def test_the_start_offset_and_the_cap_select_rows() -> None:
    rows = [TraceRequest(t, 10, 1) for t in (0.0, 1.0, 2.0, 3.0)]
    assert [r.arrival_s for r in select_rows(rows, 1.5)] == [2.0, 3.0]
    assert [r.arrival_s for r in select_rows(rows, 0.5, 2)] == [1.0, 2.0]


@pytest.mark.parametrize("cost", [PromptCost(1, 7), PromptCost(4, 23), PromptCost(1, 0)])
def test_exact_prompts_cost_what_was_asked(cost: PromptCost) -> None:
    def tokens(text: str) -> int:  # a BPE-like count for 1, a byte count otherwise
        words = text.split()
        return cost.fixed + (len(words) if cost.per_word == 1 else len(text.encode()))

    rng = np.random.default_rng(0)
    for n in (cost.fixed + 1, 100, 513, 2049):
        assert tokens(exact_prompt(rng, n, cost)) == n
        assert tokens(block_prompt([5, 6, 7, 8, 9], n, cost, seed=1)) == n


def test_shared_block_ids_share_the_prompt_prefix() -> None:
    cost = PromptCost(4, 10)
    a = block_prompt([0, 1, 2], 1100, cost, seed=3)
    b = block_prompt([0, 3], 700, cost, seed=3)
    c = block_prompt([9, 1], 700, cost, seed=3)
    block = MOONCAKE_BLOCK_TOKENS * 4 // cost.per_word  # one block's characters here
    assert a[:block] == b[:block] and a[block : block + 8] != b[block : block + 8]
    assert a[:block] != c[:block]


@pytest.fixture(scope="module")
def carousel() -> Iterator[str]:
    """A Carousel (sim backend: a byte-level tokenizer) with the arms `static` and `orca`."""
    arms = [sim_arm(scheduler="static", max_model_len=4096, num_blocks=2048),
            sim_arm(scheduler="orca", max_model_len=4096, num_blocks=2048)]  # fmt: skip
    settings = Settings(backend="sim", served_model_name=SIM_MODEL)
    with serve_app(create_app(settings, [Deployment(SIM_MODEL, arms)])) as url:
        yield url


def replay(url: str, trace: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--url", url, "--replay", str(trace), "--arm", "static", "--arm", "orca",
        "--result-dir", str(out), "--no-progress", "--warmups", "0", "--no-trace",
        "--resamples", "200", *extra,
    ]  # fmt: skip


def sent(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "requests.jsonl").open()]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_replayed_trace_sends_exactly_its_lengths_to_carousel(
    carousel: str, traces: dict[str, Path], tmp_path: Path, endpoint: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    argv = replay(
        carousel, traces["azure"], tmp_path, "--endpoint", endpoint, "--time-scale", "0.1"
    )
    assert main(argv) == 0
    lines = sent(tmp_path)
    for arm in ("static", "orca"):
        mine = sorted((r for r in lines if r["arm"] == arm), key=lambda r: r["index"])  # type: ignore[arg-type,return-value]
        assert [r["prompt_tokens"] for r in mine] == [374, 396, 879, 91]
        assert [r["output_tokens"] for r in mine] == [44, 109, 20, 7]
    report = json.loads((tmp_path / "report.json").read_text())
    replayed = report["config"]["replay"]
    assert replayed["format"] == "azure" and replayed["exact_prompt_lengths"] is True
    assert replayed["span_s"] == pytest.approx(0.15)
    assert "what orca buys against static (the baseline)" in capsys.readouterr().out


def test_mooncake_replay_shares_prefixes_and_honours_the_start_and_cap(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    with fake_server() as (url, seen):  # counts a prompt's tokens as its words
        argv = replay(url, traces["mooncake"], tmp_path, "--model", "toy", "--max-requests",
                      "2", "--replay-start", "0.1")  # fmt: skip
        assert main(argv) == 0
    assert [s["arm"] for s in seen] == ["static"] * 2 + ["orca"] * 2
    prompts = [s["body"]["messages"][0]["content"] for s in seen[:2]]
    assert [len(p.split()) for p in prompts] == [700, 30]
    assert [s["body"]["max_tokens"] for s in seen[:2]] == [3, 9]
    assert all(s["body"]["ignore_eos"] is True for s in seen)


def test_mooncake_requests_with_a_shared_id_share_their_first_block(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    with fake_server() as (url, seen):
        assert main(replay(url, traces["mooncake"], tmp_path, "--model", "toy")) == 0
    first, second = (s["body"]["messages"][0]["content"].split() for s in seen[:2])
    assert len(first) == 1100 and len(second) == 700
    assert first[:512] == second[:512] and first[512:520] != second[512:520]


def test_sharegpt_replay_sends_its_questions_at_the_rate(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    with fake_server() as (url, seen):
        argv = replay(url, traces["sharegpt"], tmp_path, "--model", "toy", "--request-rate", "50")
        assert main(argv) == 0
    assert [s["body"]["messages"][0]["content"] for s in seen[:2]] == [
        "What is paged attention?", "Hi"
    ]  # fmt: skip
    assert [s["body"]["max_tokens"] for s in seen[:2]] == [9, 1]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["replay"]["format"] == "sharegpt"
    assert report["config"]["replay"]["exact_prompt_lengths"] is False  # the text as written


def test_a_timed_trace_refuses_a_rate(traces: dict[str, Path], tmp_path: Path) -> None:
    argv = replay("http://127.0.0.1:9", traces["azure"], tmp_path, "--model", "m", "--rate", "3")
    assert main(argv) == 2
