"""scripts/greedy_agreement.py: each endpoint's greedy answers against the first's, exact
matches and the shared word prefix, on data with known answers and on live servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from greedy_agreement import PROMPTS, agreement, shared_prefix  # noqa: E402

from tests.conftest import serve_app  # noqa: E402


def test_agreement_counts_equal_answers_and_the_words_shared_before_they_part() -> None:
    reference = ["the cat sat down", "one two", "same words here", ""]
    answers = ["the cat ran off", "one two", "same words here", ""]
    result = agreement(reference, answers)
    assert (result.exact, result.answers) == (3, 4)
    assert result.mean_shared_prefix == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    assert shared_prefix("a b c", "x b c") == 0.0
    assert shared_prefix("a b", "a b c d") == 1.0  # the reference's words all repeated
    with pytest.raises(ValueError, match="one answer per prompt"):
        agreement(["a"], [])


def fixed_answer_server() -> FastAPI:
    """An OpenAI-compatible endpoint that completes every prompt with the same words."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fixed", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        return {"choices": [{"index": 0, "text": FIXED, "finish_reason": "stop"}]}

    return app


FIXED = "Nothing to say."


def test_identical_servers_agree_on_every_answer_and_another_on_none(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    with serve_app(fixed_answer_server()) as fixed:
        cmd = [
            sys.executable, "scripts/greedy_agreement.py", "--max-tokens", "8",
            "--carousel", "a=--backend sim", "--carousel", "b=--backend sim",
            "--url", f"c={fixed}/v1", "--log-dir", str(tmp_path), "--json-out", str(out),
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    n = len(PROMPTS)
    assert report["rows"] == [
        {"endpoint": "b", "reference": "a", "exact": n, "answers": n, "mean_shared_prefix": 1.0},
        {"endpoint": "c", "reference": "a", "exact": 0, "answers": n, "mean_shared_prefix": 0.0},
    ]
    assert all(answer and answer != FIXED for answer in report["answers"]["a"])
    assert report["answers"]["c"] == [FIXED] * n
    assert f"b against a: {n}/{n} answers equal" in done.stdout
