"""`carousel` CLI: settings precedence, `generate`, and the real `serve` in a subprocess."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli import build_parser, load_settings, main
from gateway.settings.load import Settings
from tests.serve_process import Served, serve_processes

REPO = Path(__file__).resolve().parents[1]


def settings_from(argv: list[str]) -> Settings:
    return load_settings(build_parser().parse_args(["serve", *argv]))


def test_flags_beat_env_beat_yaml_beat_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "carousel.yaml"
    config.write_text("port: 9001\nmax-num-seqs: 3\nscheduler: static\nblock_size: 32\n")
    monkeypatch.setenv("CAROUSEL_PORT", "9002")
    monkeypatch.setenv("CAROUSEL_SCHEDULER", "orca")
    settings = settings_from(["--config", str(config), "--port", "9003"])
    assert settings.port == 9003  # flag
    assert settings.scheduler == "orca"  # env over YAML
    assert settings.max_num_seqs == 3  # YAML
    assert settings.block_size == 32  # YAML
    assert settings.max_num_batched_tokens == 2048  # default
    assert settings.host == "127.0.0.1"


def test_config_file_from_env_and_api_keys_from_a_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("api_keys: [a, b]\nlog_prompts: true\n")
    monkeypatch.setenv("CAROUSEL_CONFIG", str(config))
    assert settings_from([]).api_keys == ["a", "b"]
    monkeypatch.setenv("CAROUSEL_API_KEYS", "x,y")
    assert settings_from([]).api_keys == ["x", "y"]
    assert settings_from(["--api-key", "k1", "--api-key", "k2"]).api_keys == ["k1", "k2"]
    assert settings_from([]).log_prompts is True


def test_prepack_weights_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from([]).prepack_weights is True
    assert settings_from(["--no-prepack-weights"]).prepack_weights is False
    monkeypatch.setenv("CAROUSEL_PREPACK_WEIGHTS", "false")
    assert settings_from([]).prepack_weights is False
    assert settings_from(["--prepack-weights"]).prepack_weights is True


def test_default_model_is_served_as_smollm2() -> None:
    assert Settings().model_name == "smollm2-135m-instruct"
    assert Settings(model="/models/Qwen3-0.6B.gguf").model_name == "Qwen3-0.6B"
    assert Settings(model="org/some-model").model_name == "org/some-model"
    assert Settings(served_model_name="mine").model_name == "mine"


def test_invalid_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "sim", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_generate_prints_a_completion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello", "--backend", "sim", "--max-tokens", "7"]) == 0
    assert len(capsys.readouterr().out.rstrip("\n")) == 7
    assert main(["generate", "Hi", "--backend", "sim", "--max-tokens", "3", "--chat"]) == 0


def test_bench_subcommand_is_registered_when_present() -> None:
    import importlib.util

    choices = build_parser()._subparsers._group_actions[0].choices
    has_bench = importlib.util.find_spec("bench") is not None and (
        importlib.util.find_spec("bench.cli") is not None
    )
    assert ("bench" in choices) == has_bench
    assert {"serve", "generate"} <= set(choices)


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.app, gateway.cli, gateway.http.routes;"
        "from gateway.app import create_app; from gateway.settings.load import Settings;"
        "create_app(Settings(backend='sim'));"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# -- the real `carousel serve` in a subprocess ---------------------------------------------


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`carousel serve --backend sim` on a free port (tests/serve_process.py), stopped by
    SIGINT at teardown unless a test stopped it."""
    flags = ["--backend", "sim", "--served-model-name", "sim"]
    flags += ["--api-key", "sekret-key", "--sim-time-scale", "0.1"]
    with serve_processes([(flags, "serve")], tmp_path_factory.mktemp("serve")) as (server,):
        yield server


def test_serve_subprocess_answers_the_sdk_with_keys(cli_server: Served) -> None:
    client = openai.OpenAI(base_url=f"{cli_server.url}/v1", api_key="sekret-key", max_retries=0)
    reply = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["sim"]
    assert httpx.get(f"{cli_server.url}/v1/models").status_code == 401


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_serve_subprocess_streams_to_curl(cli_server: Served) -> None:
    body = {"model": "sim", "prompt": "hello", "max_tokens": 4, "stream": True}
    body["stream_options"] = {"include_usage": True}
    command = ["curl", "-sS", "-N", f"{cli_server.url}/v1/completions"]
    command += ["-H", "Authorization: Bearer sekret-key", "-H", "Content-Type: application/json"]
    command += ["-d", json.dumps(body)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
    events = out.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_serve_subprocess_stops_cleanly_and_logged_json(cli_server: Served) -> None:
    httpx.post(
        f"{cli_server.url}/v1/completions",
        json={"model": "sim", "prompt": "private words", "max_tokens": 2},
        headers={"Authorization": "Bearer sekret-key"},
    )
    cli_server.proc.send_signal(signal.SIGINT)
    assert cli_server.proc.wait(15) == 0
    text = cli_server.log.read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    requests = [line for line in lines if line.get("event") == "request"]
    assert requests and all(r["status"] in (200, 401) for r in requests)
    assert "sekret-key" not in text and "private words" not in text
    # once its arms were ready, the server froze its start-up heap out of the cyclic GC
    events = [line.get("event") for line in lines]
    frozen = [line for line in lines if line.get("event") == "gc_frozen"]
    assert len(frozen) == 1 and frozen[0]["objects"] > 0
    assert events.index("gc_frozen") > events.index("arm_ready")
