"""A/B arms behind one served name: split, sticky users, header override, upstream arms,
failover, per-arm metrics and the iteration trace."""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.arms.choice import choose_by_weight, user_point
from gateway.arms.factory import deployment_from_settings
from gateway.arms.local import LocalArm
from gateway.settings.arms import ArmSettings
from gateway.settings.load import Settings
from tests.conftest import serve_app

MODEL = "ab-model"
ROOT = Path(__file__).resolve().parents[1]


def ab_settings(**extra: object) -> Settings:
    arms = extra.pop("arms", None) or [
        {"name": "orca", "scheduler": "orca", "weight": 70},
        {"name": "static", "scheduler": "static", "weight": 30},
    ]
    return Settings(backend="sim", served_model_name=MODEL, arms=arms, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ab_url() -> Iterator[str]:
    with serve_app(create_app(ab_settings())) as url:
        yield url


def chat(url: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json={**payload, **body}, headers=headers)


def test_weighted_choice_follows_the_weights() -> None:
    arms = [ArmSettings(name="a", weight=3), ArmSettings(name="b", weight=1)]
    counts = collections.Counter(choose_by_weight(arms, i / 10_000).name for i in range(10_000))
    assert counts["a"] == 7_500
    assert choose_by_weight([ArmSettings(name="z", weight=0)], 0.5) is None


def test_split_ratio_is_within_tolerance(ab_url: str) -> None:
    arms = collections.Counter(chat(ab_url).headers["X-Carousel-Arm"] for _ in range(300))
    assert set(arms) == {"orca", "static"}
    assert 0.6 <= arms["orca"] / 300 <= 0.8, arms


def test_users_are_sticky_and_spread(ab_url: str) -> None:
    for user in ("alice", "bob", "carol"):
        seen = {chat(ab_url, user=user).headers["X-Carousel-Arm"] for _ in range(15)}
        assert len(seen) == 1, (user, seen)
    spread = {chat(ab_url, user=f"user-{i}").headers["X-Carousel-Arm"] for i in range(40)}
    assert spread == {"orca", "static"}
    assert user_point("alice") == user_point("alice") != user_point("bob")


def test_header_overrides_weights_and_stickiness(ab_url: str) -> None:
    for arm in ("orca", "static"):
        for user in ("alice", "bob"):
            response = chat(ab_url, {"X-Carousel-Arm": arm}, user=user)
            assert response.status_code == 200
            assert response.headers["X-Carousel-Arm"] == arm


def test_unknown_arm_is_a_400_naming_the_header(ab_url: str) -> None:
    response = chat(ab_url, {"X-Carousel-Arm": "nope"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "X-Carousel-Arm" and error["code"] == "arm_not_found"
    assert "orca" in error["message"] and "static" in error["message"]


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def arm_value(samples: dict, name: str, arm: str, **labels: str) -> float:  # type: ignore[type-arg]
    return sum(
        v
        for (n, lbls), v in samples.items()
        if n == name and dict(lbls).get("arm") == arm
        and all(dict(lbls).get(k) == x for k, x in labels.items())
    )  # fmt: skip


def test_per_arm_metrics_are_present_and_move(ab_url: str) -> None:
    before = metric_samples(ab_url)
    for arm in ("orca", "static"):
        for _ in range(3):
            headers = {"X-Carousel-Arm": arm}
            assert chat(ab_url, headers, max_tokens=5, stream=True).status_code == 200
    after = metric_samples(ab_url)
    for arm in ("orca", "static"):
        for name, moved_by in [
            ("carousel_requests_total", 3),
            ("carousel_generation_tokens_total", 15),
            ("carousel_time_to_first_token_seconds_count", 3),
            ("carousel_inter_token_latency_seconds_count", 12),
            ("carousel_e2e_request_latency_seconds_count", 3),
            ("carousel_request_queue_time_seconds_count", 3),
            ("carousel_iteration_batch_size_count", 5),
            ("carousel_iteration_tokens_count", 5),
        ]:
            delta = arm_value(after, name, arm) - arm_value(before, name, arm)
            assert delta >= moved_by, (arm, name, delta)
        assert arm_value(after, "carousel_request_success_total", arm, finished_reason="length")
        for gauge in ("carousel_num_requests_running", "carousel_kv_cache_usage_perc"):
            assert any(n == gauge and dict(lbls)["arm"] == arm for n, lbls in after)


def test_debug_trace_serves_each_local_arms_iterations(ab_url: str) -> None:
    start = time.time()
    chat(ab_url, {"X-Carousel-Arm": "static"}, max_tokens=3)
    trace = httpx.get(f"{ab_url}/debug/trace", params={"arm": "static", "since": start}).json()
    [(name, arm)] = trace["arms"].items()
    assert name == "static" and arm["scheduler"] == "static" and arm["max_num_seqs"] >= 1
    assert len(arm["iterations"]) >= 3
    first = arm["iterations"][0]
    assert first["num_prefill_tokens"] > 0 and first["seq_ids"] and first["start"] >= start
    both = httpx.get(f"{ab_url}/debug/trace", params={"limit": 1}).json()["arms"]
    assert set(both) == {"orca", "static"} and all(len(a["iterations"]) == 1 for a in both.values())
    assert httpx.get(f"{ab_url}/debug/trace", params={"arm": "x"}).status_code == 400


def test_arm_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="belong to local arms"):
        ArmSettings(
            name="u", upstream={"base_urls": ["http://x/v1"], "model": "m"}, scheduler="orca"
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        ab_settings(arms=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValueError, match="positive weight"):
        ab_settings(arms=[{"name": "a", "weight": 0}])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_carousel(stack: ExitStack, *args: str) -> str:
    """A second Carousel process (sim backend) on loopback; stops with `stack`."""
    port = free_port()
    cmd = [
        "timeout", "300", sys.executable, "-m", "gateway.cli", "serve", "--backend", "sim",
        "--port", str(port), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return url
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "carousel did not start"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def upstream_gateway() -> Iterator[str]:
    """A gateway whose `remote` arm is another Carousel, listed after a dead replica."""
    with ExitStack() as stack:
        remote = start_carousel(stack, "--served-model-name", "remote-model")
        dead = f"http://127.0.0.1:{free_port()}/v1"
        settings = ab_settings(
            arms=[
                {"name": "local", "scheduler": "orca", "weight": 1},
                {
                    "name": "remote",
                    "weight": 1,
                    "upstream": {
                        "base_urls": [dead, f"{remote}/v1"],
                        "model": "remote-model",
                        "health_interval_s": 60,
                    },
                },
            ]
        )
        yield stack.enter_context(serve_app(create_app(settings)))


def test_upstream_arm_streams_end_to_end_through_a_second_carousel(upstream_gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{upstream_gateway}/v1", api_key="x", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Carousel-Arm": "remote"},
    ) as response:
        assert response.headers["X-Carousel-Arm"] == "remote"
        chunks = list(response.parse())
    assert all(c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_upstream_arm_fails_over_from_a_dead_replica(upstream_gateway: str) -> None:
    for stream in (False, True):
        response = chat(upstream_gateway, {"X-Carousel-Arm": "remote"}, stream=stream)
        assert response.status_code == 200, response.text
        assert response.headers["X-Carousel-Arm"] == "remote"
        if not stream:
            body = response.json()
            assert body["model"] == MODEL and body["usage"]["completion_tokens"] == 2
        else:
            assert response.text.endswith("data: [DONE]\n\n") and '"usage"' not in response.text
    samples = metric_samples(upstream_gateway)
    assert arm_value(samples, "carousel_generation_tokens_total", "remote") >= 4


def test_upstream_arm_errors_are_openai_shaped(upstream_gateway: str) -> None:
    response = chat(upstream_gateway, {"X-Carousel-Arm": "remote"}, max_tokens=10**6)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_local_torch_arms_share_one_copy_of_the_weights(tmp_path: Path) -> None:
    from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    settings = Settings(
        model=str(tmp_path), device="cpu", kv_cache_gb=0.001, max_model_len=64,
        arms=[{"name": "a", "scheduler": "orca"}, {"name": "b", "scheduler": "static"}],
    )  # type: ignore[arg-type]  # fmt: skip
    deployment = deployment_from_settings(settings)
    with serve_app(create_app(settings, [deployment])) as url:
        arms = [a for a in deployment.arms if isinstance(a, LocalArm)]
        assert arms[0].engine.backend.hf_model is arms[1].engine.backend.hf_model  # type: ignore[attr-defined]
        assert arms[0].engine.block_manager is not arms[1].engine.block_manager
        body = {"model": tmp_path.name, "prompt": "ab", "max_tokens": 3, "temperature": 0}
        texts = {
            arm: httpx.post(f"{url}/v1/completions", json=body, headers={"X-Carousel-Arm": arm})
            .json()["choices"][0]["text"]
            for arm in ("a", "b")
        }  # fmt: skip
        assert texts["a"] == texts["b"]


def test_example_ab_config_loads() -> None:
    settings = Settings.load(ROOT / "examples" / "ab.yaml")
    assert settings.model_name == "smollm2-135m-instruct"
    assert [(a.name, a.scheduler, a.weight) for a in settings.arms or []] == [
        ("orca", "orca", 50), ("static", "static", 50),
    ]  # fmt: skip
    assert os.path.exists(ROOT / "examples" / "ab.yaml")
