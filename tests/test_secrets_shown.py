"""Secrets never shown (docs/reliability.md, "Schema work and secrets"): /metrics labels carry
display URLs and no hostname or pid, `metrics_require_key` closes /metrics, the traffic
record is 0600 and scrubs credential-like fields by name at any depth, and client values
echoed in errors and access logs are cut short.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import structlog
from pydantic import ValidationError

from backends.upstream import UpstreamConfig
from gateway.arms.upstream import UpstreamArm
from gateway.obs.metrics import GatewayMetrics
from gateway.settings.load import Settings
from tests.conftest import CHAT, error_of, start_server

KEY = "sk-carousel-test-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPSTREAM_PASSWORD = "pa55-w0rd-upstream"
QUERY_KEY = "qk-9f8e7d6c"


def test_metrics_labels_show_display_urls_and_no_host_or_pid() -> None:
    url = f"http://carousel:{UPSTREAM_PASSWORD}@10.0.0.7:8001/v1?api-key={QUERY_KEY}"
    arm = UpstreamArm("remote", UpstreamConfig(base_urls=(url,), model="m"))
    text = GatewayMetrics(arm_info=lambda: [arm.info("m")]).render().decode()
    assert 'device_group="upstream:http://10.0.0.7:8001/v1"' in text
    assert UPSTREAM_PASSWORD not in text and QUERY_KEY not in text
    text = GatewayMetrics(arm_info=lambda: []).render().decode()
    assert socket.gethostname() not in text and f":{os.getpid()}" not in text


def test_metrics_require_key_closes_metrics_and_needs_keys(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with ExitStack() as stack:
        server = start_server(stack, api_keys=[KEY], metrics_require_key=True)
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    with pytest.raises(ValidationError, match="metrics_require_key needs API keys"):
        Settings(backend="sim", metrics_require_key=True)  # type: ignore[call-arg]
    assert KEY not in capfd.readouterr().err


def test_the_traffic_record_is_private_and_scrubs_credentials_by_name(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "traffic.jsonl"
    secrets = ["tok-111", "sec-222", "pw-333", "key-444", "auth-555"]
    body = {
        **CHAT,
        "session_token": secrets[0],
        "vendor": {"client_secret": secrets[1], "deep": [{"DB_Password": secrets[2]}]},
        "x-goog-api-key": secrets[3],
        "proxy": {"Proxy-Authorization": secrets[4]},
    }
    with ExitStack() as stack:
        server = start_server(stack, api_keys=[KEY], record_traffic=str(record))
        with structlog.testing.capture_logs() as logs:
            reply = httpx.post(f"{server.v1}/chat/completions", json=body, headers=AUTH)
            assert reply.status_code == 200, reply.text
            metrics = httpx.get(f"{server.url}/metrics").text
    deadline = time.monotonic() + 10
    while not record.exists() or not record.read_text().strip():
        assert time.monotonic() < deadline, "nothing was recorded"
        time.sleep(0.05)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    text = record.read_text()
    assert '"max_tokens": 2' in text or '"max_tokens":2' in text  # parameters are kept
    assert any(entry["event"] == "request" for entry in logs)
    shown = text + capfd.readouterr().err + metrics + json.dumps(logs, default=str)
    for secret in [KEY, *secrets]:
        assert secret not in shown, secret


def test_oversized_client_values_are_cut_in_errors_and_logs(
    capfd: pytest.CaptureFixture[str],
) -> None:
    huge_model = "m" * (1 << 20)
    huge_arm = "a" * 10_000
    with ExitStack() as stack:
        server = start_server(stack)
        logs = stack.enter_context(structlog.testing.capture_logs())
        reply = httpx.post(f"{server.v1}/chat/completions", json={**CHAT, "model": huge_model})
        error = error_of(reply, 404)
        assert len(reply.content) < 2_000 and "1048576 characters" in error["message"]
        reply = httpx.post(
            f"{server.v1}/chat/completions", json=CHAT, headers={"X-Carousel-Arm": huge_arm}
        )
        error = error_of(reply, 400)
        assert len(reply.content) < 2_000 and "10000 characters" in error["message"]
    assert [entry["status"] for entry in logs if entry["event"] == "request"] == [404, 400]
    logged = capfd.readouterr().err + json.dumps(logs, default=str)
    assert "m" * 1000 not in logged and "a" * 1000 not in logged
