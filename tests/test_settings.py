"""One settings model: flags, env, YAML and per-arm overrides all derive from its fields,
policies own their options, and bad settings are refused before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.arms.engine_factory import scheduler_config, serving_options
from gateway.arms.factory import arm_settings, deployment_from_settings
from gateway.arms.local import LocalArm
from gateway.cli import build_parser, load_settings
from gateway.settings.groups import GROUPS, group_fields, per_arm_names
from gateway.settings.load import Settings
from gateway.settings.policy_options import policy_option_names
from schedulers.backend import Backend
from schedulers.engine import Engine
from schedulers.registry import available_schedulers

REPO = Path(__file__).resolve().parents[1]
#: the built-in policies, as a refusal lists them
AVAILABLE = ", ".join(available_schedulers())


def settings_from(argv: list[str]) -> Settings:
    return load_settings(build_parser().parse_args(["serve", *argv]))


def test_every_setting_is_a_flag_an_env_var_and_a_yaml_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = build_parser()
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for group in GROUPS:
        for name, _ in group_fields(group):
            flag = "--api-key" if name == "api_keys" else "--" + name.replace("_", "-")
            assert flag in help_text, flag
    config = tmp_path / "c.yaml"
    config.write_text("max_prompt_tokens: 77\n")
    monkeypatch.setenv("CAROUSEL_DEFAULT_MAX_TOKENS", "99")
    settings = settings_from(["--config", str(config), "--sse-ping-s", "2.5"])
    assert (settings.max_prompt_tokens, settings.default_max_tokens) == (77, 99)
    assert settings.sse_ping_s == 2.5


def test_help_groups_the_flags() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    titles = [g.title or "" for g in serve._action_groups]
    for group in ("model", "cache", "scheduler", "engine", "server"):
        assert any(t.startswith(f"{group}:") for t in titles), titles
    policy = next(g for g in serve._action_groups if "policy options" in (g.title or ""))
    assert sorted(a.dest for a in policy._group_actions) == policy_option_names()
    assert "batch_wait_ms" in policy_option_names()


def test_a_policy_option_comes_from_flags_env_yaml_and_reaches_its_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("scheduler: static\nbatch-wait-ms: 7\n")
    assert settings_from(["--config", str(config)]).scheduler_options == {"batch_wait_ms": 7.0}
    monkeypatch.setenv("CAROUSEL_BATCH_WAIT_MS", "8")
    assert settings_from(["--config", str(config)]).scheduler_options == {"batch_wait_ms": 8.0}
    settings = settings_from(["--config", str(config), "--batch-wait-ms", "9"])
    assert settings.scheduler_options == {"batch_wait_ms": 9.0}
    engine = _engine_of(settings)
    assert engine.scheduler.options.batch_wait_ms == 9.0  # type: ignore[attr-defined]


def _engine_of(settings: Settings) -> Engine:
    from backends.sim import SimBackend

    backend: Backend = SimBackend()
    return Engine(
        backend,
        settings.scheduler,
        scheduler_config(settings),
        policy_options=settings.scheduler_options,
    )


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("max_num_seq: 8\n", "did you mean 'max_num_seqs'"),
        ("scheduler: fifo\n", f"available: {AVAILABLE}"),
        ("batch_wait_ms: -1\n", "batch_wait_ms must be at least 0"),
        ("max_num_seqs: 0\n", "max_num_seqs"),
        ("arms:\n  - name: a\n    max_num_seq: 3\n", "did you mean 'max_num_seqs'"),
        ("arms:\n  - name: a\n    scheduler: fifo\n", f"available: {AVAILABLE}"),
    ],
)
def test_bad_settings_are_refused_naming_what_is_valid(
    tmp_path: Path, yaml_text: str, needle: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(")):
        Settings.load(config)


def test_unknown_key_lists_every_valid_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("colour: blue\n")
    with pytest.raises(ValidationError) as info:
        Settings.load(config)
    for name in ("max_num_seqs", "kv_cache_gb", "batch_wait_ms", "port", "arms"):
        assert name in str(info.value)


def test_every_per_arm_setting_is_an_arm_override_with_no_extra_code() -> None:
    per_arm = [n for n in per_arm_names() if n not in ("scheduler",)]
    assert {"max_prompt_tokens", "kv_cache_gb", "enable_chunked_prefill", "backend"} <= set(per_arm)
    settings = Settings(
        backend="sim",
        max_prompt_tokens=100,
        arms=[
            {"name": "a", "max_prompt_tokens": 5, "batch_wait_ms": 3, "scheduler": "static"},
            {"name": "b"},
        ],
    )  # type: ignore[arg-type]
    assert settings.arms is not None
    a, b = (arm_settings(settings, arm) for arm in settings.arms)
    assert serving_options(a).max_prompt_tokens == 5
    assert serving_options(b).max_prompt_tokens == 100
    assert (a.scheduler, a.scheduler_options) == ("static", {"batch_wait_ms": 3.0})
    deployment = deployment_from_settings(settings)
    assert [arm.name for arm in deployment.arms if isinstance(arm, LocalArm)] == ["a", "b"]


def test_upstream_arms_take_no_engine_knobs() -> None:
    upstream = {"base_urls": ["http://127.0.0.1:1/v1"], "model": "m"}
    with pytest.raises(ValidationError, match="belong to local arms"):
        Settings(arms=[{"name": "u", "upstream": upstream, "batch_wait_ms": 3}])  # type: ignore[list-item]


def test_serve_refuses_an_unknown_scheduler_before_opening_the_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAROUSEL_")}
    command = [sys.executable, "-m", "gateway.cli", "serve", "--backend", "sim"]
    command += ["--port", str(port), "--scheduler", "fifo"]
    began = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown scheduler 'fifo'" in result.stderr and AVAILABLE in result.stderr
    assert "Uvicorn running" not in result.stderr + result.stdout
    assert time.monotonic() - began < 30


def test_every_flag_has_its_line_in_the_quickstart() -> None:
    """Adding a knob is one field plus its docs line: this holds the docs to it."""
    from gateway.settings.policy_options import policy_option_names

    text = (REPO / "docs" / "quickstart.md").read_text()
    names = [name for group in GROUPS for name, _ in group_fields(group)]
    for name in [*names, *policy_option_names()]:
        flag = "--api-key" if name == "api_keys" else "--" + name.replace("_", "-")
        plain = flag.removeprefix("--")
        assert flag in text or f"--[no-]{plain}" in text, f"{flag} is not in docs/quickstart.md"
