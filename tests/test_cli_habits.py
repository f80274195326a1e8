"""vLLM's habits in `carousel`: `serve MODEL`, `--version`, `--dtype auto`, `--log-format`,
and setting errors one line per problem with secrets redacted."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import structlog
import torch
from pydantic import ValidationError

import backends.torch.runner.backend as runner
from backends.torch.runner.backend import TorchBackend, resolve_dtype
from backends.torch.testing.tiny_models import tiny_model, tiny_tokenizer
from gateway import carousel_version
from gateway.cli import build_parser, load_settings, main
from gateway.obs.logging import configure_logging, json_logs
from gateway.settings.errors import REDACTED, problem_lines, redact, redact_url
from gateway.settings.load import Settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def settings_from(argv: list[str]) -> Settings:
    return load_settings(build_parser().parse_args(["serve", *argv]))


def test_serve_takes_the_model_as_its_first_argument() -> None:
    settings = settings_from(["/models/Qwen3-0.6B.gguf", "--backend", "sim", "--port", "9"])
    assert settings.model == "/models/Qwen3-0.6B.gguf"
    assert settings.model_name == "Qwen3-0.6B"
    flags_after = settings_from(["--backend", "sim", "org/model"])
    assert flags_after.model == "org/model"
    assert settings_from(["--model", "m", "m"]).model == "m"  # the same model twice is one


def test_two_different_models_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "a-model", "--model", "another", "--backend", "sim"]) == 2
    err = capsys.readouterr().err
    assert "model: given twice, as 'a-model' and --model 'another'" in err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"carousel {carousel_version()}"


# -- --dtype auto ------------------------------------------------------------------------------


def test_dtype_auto_is_the_default_and_a_bad_dtype_fails_before_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert Settings().dtype == "auto"
    assert settings_from(["--dtype", "auto"]).dtype == "auto"
    config = tmp_path / "c.yaml"
    config.write_text("dtype: half\n")
    assert Settings.load(config).dtype == "float16"  # vLLM's alias
    config.write_text("dtype: int8\n")
    with pytest.raises(ValidationError, match="dtype"):
        Settings.load(config)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("native_bf16", [True, False])
def test_dtype_auto_on_a_cpu_is_bf16_only_with_bf16_products(
    native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "cpu_has_native_bf16", lambda: native_bf16)
    want = torch.bfloat16 if native_bf16 else torch.float32
    for checkpoint in (None, torch.float32, torch.bfloat16, torch.float16):
        assert resolve_dtype("auto", CPU, checkpoint) == want
    assert resolve_dtype(None, CPU) == want


def test_dtype_auto_on_cuda_keeps_a_half_checkpoint() -> None:
    assert resolve_dtype("auto", CUDA, torch.float16) == torch.float16
    assert resolve_dtype("auto", CUDA, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", CUDA, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", CUDA, None) == torch.bfloat16
    assert resolve_dtype("float32", CUDA, torch.float16) == torch.float32


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_backend_built_with_dtype_auto_runs_in_the_resolved_dtype(
    native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "cpu_has_native_bf16", lambda: native_bf16)
    backend = TorchBackend(
        tiny_model("llama"), tiny_tokenizer(), device="cpu", dtype="auto", cpu_kernels=False
    )
    want = torch.bfloat16 if native_bf16 else torch.float32
    assert backend.dtype == want
    assert backend.hf_model.dtype == want


# -- --log-format ------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_format_auto_is_text_on_a_terminal_and_json_elsewhere() -> None:
    assert json_logs("auto", _Terminal()) is False
    assert json_logs("auto", io.StringIO()) is True
    for stream in (_Terminal(), io.StringIO()):
        assert json_logs("json", stream) is True
        assert json_logs("text", stream) is False
    assert settings_from([]).log_format == "auto"
    assert settings_from(["--log-format", "text"]).log_format == "text"


@pytest.mark.parametrize("json_lines", [True, False])
def test_configured_logs_render_as_chosen(
    json_lines: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        configure_logging("info", json_lines)
        structlog.get_logger("carousel.test").info("hello_there", answer=42)
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers = []
    if json_lines:
        assert json.loads(line)["event"] == "hello_there"
    else:
        assert "hello_there" in line and "answer=42" in line
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)


# -- setting errors ----------------------------------------------------------------------------

SECRET_KEY = "sk-verysecret-12345"
BAD_SETTINGS = f"""\
max_num_seqs: 0
port: 70000
arms:
  - name: u
    upstream:
      base_urls: "http://bob:hunter2@10.0.0.5:8000/v1"
      model: m
      api_key: [{SECRET_KEY!r}]
"""


def test_setting_errors_are_one_line_each_without_addresses_or_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_SETTINGS)
    assert main(["serve", "--backend", "sim", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0] == "carousel: invalid settings (4 problems):"
    assert lines[1:3] == [
        "  max_num_seqs: Input should be greater than or equal to 1 (got 0)",
        "  port: Input should be less than or equal to 65535 (got 70000)",
    ]
    assert lines[3].startswith("  arms[0].upstream.base_urls: Input should be a valid list")
    assert "http://bob:<redacted>@10.0.0.5:8000/v1" in lines[3]
    assert lines[4].startswith("  arms[0].upstream.api_key: ")
    assert "errors.pydantic.dev" not in err and "For further information" not in err
    assert "hunter2" not in err and SECRET_KEY not in err


def test_a_secret_setting_is_redacted_whatever_its_value() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(arms=[{"name": "u", "upstream": {"base_urls": ["x"], "model": "m", "api_key": 9}}])  # type: ignore[list-item]
    [line] = problem_lines(info.value)
    assert line == f"arms[0].upstream.api_key: Input should be a valid string (got {REDACTED})"


def test_redaction_of_urls_keeps_everything_but_the_password() -> None:
    assert redact_url("https://u:p4ss@host:8443/v1?x=1") == f"https://u:{REDACTED}@host:8443/v1?x=1"
    assert redact_url("http://host/v1") == "http://host/v1"
    assert redact_url("redis://:pw@127.0.0.1:6379/0") == f"redis://:{REDACTED}@127.0.0.1:6379/0"
    text = "upstreams http://a:b@h1/v1 and http://h2/v1"
    assert redact(text) == f"upstreams http://a:{REDACTED}@h1/v1 and http://h2/v1"
