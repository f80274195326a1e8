"""`--speculative-config` from the flag, the YAML (top level and per arm) to each arm's engine,
refused where it cannot run; and a live server whose speculating arm streams through the
OpenAI SDK beside an arm without speculation, with vLLM's counters per arm on /metrics.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError

from backends.sim import SimBackend
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from gateway.app import create_app
from gateway.arms.arm import Arm
from gateway.arms.deployment import Deployment
from gateway.arms.engine_factory import scheduler_config
from gateway.arms.factory import arm_settings
from gateway.arms.local import LocalArm
from gateway.cli import build_parser, load_settings
from gateway.settings.load import Settings
from schedulers.base import SchedulerConfig
from schedulers.engine import Engine
from schedulers.spec_decode.config import SpeculativeConfig
from tests.conftest import SIM_MODEL, LiveServer, serve_app
from tests.spec_workload import SPEC

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
PARSED = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)


def settings_from(argv: list[str]) -> Settings:
    return load_settings(build_parser().parse_args(["serve", *argv]))


def test_the_flag_reaches_the_scheduler_config() -> None:
    assert scheduler_config(settings_from([])).speculative_config is None
    settings = settings_from(["--speculative-config", NGRAM])
    assert scheduler_config(settings).speculative_config == PARSED


def test_yaml_arms_put_speculation_against_none(tmp_path: Path) -> None:
    config = tmp_path / "ab.yaml"
    config.write_text(
        "speculative_config: " + json.dumps(NGRAM) + "\n"
        "arms:\n"
        "  - name: inherits\n"
        "  - name: none\n"
        '    speculative_config: ""\n'
        "  - name: own\n"
        "    speculative_config: {method: ngram, num_speculative_tokens: 5}\n"
    )
    settings = settings_from(["--config", str(config)])
    assert settings.arms is not None
    specs = [
        scheduler_config(arm_settings(settings, arm)).speculative_config for arm in settings.arms
    ]
    assert specs == [PARSED, None, SpeculativeConfig(num_speculative_tokens=5)]


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"speculative_config": '{"method": "eagle", "num_speculative_tokens": 2}'}, "draft model"),
        ({"speculative_config": "{not json"}, "not valid JSON"),
        ({"arms": [{"name": "a", "speculative_config": {"method": "ngram"}}]}, "needs num_spec"),
        ({"speculative_config": NGRAM, "backend": "sim"}, "sim cannot honour speculative_config"),
        (
            {"speculative_config": NGRAM, "tensor_parallel_size": 2},
            "cannot honour speculative_config",
        ),
    ],
)
def test_a_config_that_cannot_run_is_refused_at_start_up(
    given: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValidationError, match=needle):
        Settings(**given)  # type: ignore[arg-type]


def test_an_engine_over_a_backend_that_cannot_verify_refuses_it() -> None:
    with pytest.raises(ValueError, match="cannot verify draft tokens"):
        Engine(SimBackend(), "orca", SchedulerConfig(speculative_config=SPEC))


# -- a live server ---------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    """Two local arms over one tiny model (mistral: it repeats itself): `spec` speculates,
    `plain` does not."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("mistral")
    arms: list[Arm] = []
    for name, spec in (("spec", SPEC), ("plain", None)):
        backend = TorchBackend(model, tokenizer, device="cpu", kv_cache_gb=0.02, block_size=16)
        config = SchedulerConfig(max_num_seqs=8, speculative_config=spec)
        arms.append(LocalArm.from_backend(backend, name=name, config=config))
    app = create_app(Settings(backend="sim"), [Deployment(SIM_MODEL, arms)])
    with ExitStack() as stack:
        url = stack.enter_context(serve_app(app))
        yield LiveServer(url, app, arms[0])  # type: ignore[arg-type]


def stream(server: LiveServer, arm: str, prompt: str) -> tuple[str, list[str], str | None]:
    """(text, each chunk's content, finish reason) of a streamed greedy chat completion."""
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    pieces: list[str] = []
    finish = None
    chunks = client.chat.completions.create(
        model=SIM_MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
        max_tokens=40, temperature=0, extra_headers={"X-Carousel-Arm": arm},
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), pieces, finish


def test_streaming_with_speculation_gives_the_same_answer(live: LiveServer) -> None:
    """The same text and finish; in fewer chunks where drafts were accepted (a verified step's
    tokens arrive together, in one chunk)."""
    prompts = ["abcabcabcabcabcab", "the cat sat on the mat, the cat sat on the", "xyxyxyxyxyxy"]
    fewer = 0
    for prompt in prompts:
        fast, fast_pieces, fast_finish = stream(live, "spec", prompt)
        plain, plain_pieces, plain_finish = stream(live, "plain", prompt)
        assert fast == plain and fast_finish == plain_finish == "length"
        fewer += len(fast_pieces) < len(plain_pieces)
    assert fewer
    engine = live.arm.engine
    stats = engine.scheduler.drafter.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_metrics_count_drafts_per_arm_in_vllms_names(live: LiveServer) -> None:
    stream(live, "spec", "abababababababab")
    text = httpx.get(f"{live.url}/metrics").text
    stats = live.arm.engine.scheduler.drafter.stats  # type: ignore[union-attr]
    for name, value in (
        ("num_drafts", stats.num_drafts),
        ("num_draft_tokens", stats.num_draft_tokens),
        ("num_accepted_tokens", stats.num_accepted_tokens),
    ):
        pattern = rf'carousel_spec_decode_{name}_total\{{arm="spec",model="{SIM_MODEL}"\}} (\S+)'
        found = re.search(pattern, text)
        assert found is not None, name
        assert float(found.group(1)) == value > 0
    assert 'arm="plain"' in text and not re.search(r'spec_decode\w*\{arm="plain"', text)
    per_pos = re.findall(
        r'carousel_spec_decode_num_accepted_tokens_per_pos_total\{arm="spec"', text
    )
    assert len(per_pos) == SPEC.num_speculative_tokens
