"""Prefix caching through the gateway: the knob (flag, env, YAML, per arm) reaches each arm's
engine, usage reports `prompt_tokens_details.cached_tokens`, and /metrics and /debug/trace
count what the cache served. Two simulator arms behind one name: caching on and off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.byte_tokenizer import ByteTokenizer
from gateway.app import create_app
from gateway.arms.engine_factory import scheduler_config
from gateway.arms.factory import arm_settings
from gateway.cli import build_parser, load_settings
from gateway.settings.load import Settings
from tests.conftest import serve_app

MODEL = "prefix-model"
BS = 16
SYSTEM = {"role": "system", "content": "You answer questions about trains. " * 8}


def messages(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": question}]


def shared_blocks(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    """Tokens in the full blocks two chat prompts share (the byte tokenizer's template)."""
    x, y = (ByteTokenizer().apply_chat_template(m, tokenize=True) for m in (a, b))
    common = next(i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t)
    return common // BS * BS


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    arms = [
        {"name": "on", "enable_prefix_caching": True},
        {"name": "off", "enable_prefix_caching": False},
    ]
    settings = Settings(backend="sim", served_model_name=MODEL, block_size=BS, arms=arms)  # type: ignore[arg-type]
    with serve_app(create_app(settings)) as url:
        yield url


def client(url: str, arm: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", default_headers={"X-Carousel-Arm": arm})


def test_the_knob_comes_from_flags_env_yaml_and_per_arm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parsed(*argv: str) -> bool:
        args = build_parser().parse_args(["serve", *argv])
        return scheduler_config(load_settings(args)).enable_prefix_caching

    default = Settings().enable_prefix_caching
    assert parsed() is default
    assert parsed("--enable-prefix-caching") is True
    assert parsed("--no-enable-prefix-caching") is False
    config = tmp_path / "c.yaml"
    config.write_text(f"enable_prefix_caching: {str(not default).lower()}\n")
    assert parsed("--config", str(config)) is (not default)
    monkeypatch.setenv("CAROUSEL_ENABLE_PREFIX_CACHING", "true")
    assert parsed() is True
    settings = Settings(arms=[{"name": "a", "enable_prefix_caching": False}, {"name": "b"}])  # type: ignore[list-item]
    assert settings.arms is not None
    a, b = (scheduler_config(arm_settings(settings, arm)) for arm in settings.arms)
    assert (a.enable_prefix_caching, b.enable_prefix_caching) == (False, True)


def test_usage_reports_the_prompt_tokens_served_from_the_cache(url: str) -> None:
    first, second = messages("Which line is fastest?"), messages("Which line is oldest?")
    expect = shared_blocks(first, second)
    assert expect >= 5 * BS
    for arm, cached in (("on", expect), ("off", 0)):
        api = client(url, arm)
        warm = api.chat.completions.create(model=MODEL, messages=first, max_tokens=3)  # type: ignore[arg-type]
        assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
        response = api.chat.completions.create(model=MODEL, messages=second, max_tokens=3)  # type: ignore[arg-type]
        assert response.usage is not None and response.usage.prompt_tokens_details is not None
        assert response.usage.prompt_tokens_details.cached_tokens == cached
        stream = api.chat.completions.create(
            model=MODEL, messages=second, max_tokens=3, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        assert usage.prompt_tokens_details is not None
        full = (usage.prompt_tokens - 1) // BS * BS  # the same prompt again: all but the end
        assert usage.prompt_tokens_details.cached_tokens == (full if arm == "on" else 0)


def test_completions_count_each_prompt_once(url: str) -> None:
    api = client(url, "on")
    prompt = "Once upon a time, in a land of many trains, " * 4
    api.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    response = api.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=2, n=2)
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    full = (len(prompt.encode()) - 1) // BS * BS
    assert response.usage.prompt_tokens == 2 * len(prompt.encode())
    assert response.usage.prompt_tokens_details.cached_tokens == 2 * full


def test_metrics_and_trace_count_the_cached_tokens(url: str) -> None:
    api = client(url, "on")
    before = scrape(url)
    usages = []
    for question in ("Is it late?", "Is it early?"):
        response = api.chat.completions.create(
            model=MODEL, messages=messages(question), max_tokens=2  # type: ignore[arg-type]
        )  # fmt: skip
        assert response.usage is not None and response.usage.prompt_tokens_details is not None
        usages.append(response.usage)
    after = scrape(url)

    def grew(name: str) -> float:
        return after[name, "on"] - before.get((name, "on"), 0.0)

    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)  # type: ignore[union-attr]
    assert grew("carousel_prefix_cache_hits_total") == cached > 0
    assert grew("carousel_prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert after["carousel_prefix_cache_hits_total", "off"] == 0
    assert 0 < after["carousel_prefix_cache_blocks_perc", "on"] < 1
    assert after["carousel_prefix_cache_blocks_perc", "off"] == 0
    trace = httpx.get(f"{url}/debug/trace", params={"arm": "on"}).json()["arms"]["on"]
    served = [it["num_cached_tokens"] for it in trace["iterations"]]
    assert sum(served) == after["carousel_prefix_cache_hits_total", "on"]
    assert usages[-1].prompt_tokens_details.cached_tokens in served  # type: ignore[union-attr]


def scrape(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, sample.labels.get("arm", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("carousel_prefix_cache")
    }
