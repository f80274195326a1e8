"""With API keys set, every route but /health (and /metrics while `metrics_open`) needs one;
keys never reach the logs; prompts reach them only when `log_prompts` is on."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import structlog
from fastapi import FastAPI
from starlette.routing import Route

from tests.conftest import SIM_MODEL, LiveServer
from tests.test_reliability_shutdown import carousel_serve

KEY = "sk-carousel-right-4f1b9a"
WRONG = "sk-carousel-wrong-77d0c3"
CHAT = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def route_calls(app: FastAPI) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the app serves (path params filled in): the
    OpenAPI operations plus the documentation routes that are not in the schema."""
    calls = [
        (method.upper(), re.sub(r"\{[^}]+\}", SIM_MODEL, path))
        for path, operations in app.openapi()["paths"].items()
        for method in operations
    ]
    for route in app.routes:
        if isinstance(route, Route):
            calls += [(m, route.path) for m in sorted(route.methods or {"GET"}) if m != "HEAD"]
    return calls


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.text)
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    assert KEY not in response.text and WRONG not in response.text


def test_every_route_but_health_and_metrics_needs_a_key(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(api_keys=[KEY, "another-key"])
    calls = route_calls(srv.app)
    paths = {path for _, path in calls}
    assert {"/v1/chat/completions", "/v1/models", "/version", "/openapi.json"} <= paths
    assert "/debug/trace" in paths
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        for method, path in [*calls, ("GET", "/no/such/route"), ("POST", "/v1/embeddings")]:
            body = CHAT if method == "POST" else None
            if path in ("/health", "/metrics"):
                assert http.request(method, path).status_code == 200
                continue
            assert_401(http.request(method, path, json=body))
            assert_401(http.request(method, path, json=body, headers=bearer(WRONG)))
            assert_401(http.request(method, path, json=body, headers={"Authorization": KEY}))
            granted = http.request(method, path, json=body, headers=bearer(KEY))
            assert granted.status_code != 401, (path, granted.text)
        chat = http.post("/v1/chat/completions", json=CHAT, headers=bearer("another-key"))
        assert chat.status_code == 200


def test_debug_trace_needs_a_key(make_server: Callable[..., LiveServer]) -> None:
    srv = make_server(api_keys=[KEY])
    assert_401(httpx.get(f"{srv.url}/debug/trace"))
    assert_401(httpx.get(f"{srv.url}/debug/trace", headers=bearer(WRONG)))
    response = httpx.get(f"{srv.url}/debug/trace", headers=bearer(KEY))
    assert response.status_code == 200 and "arms" in response.json()


def test_metrics_need_a_key_unless_open(make_server: Callable[..., LiveServer]) -> None:
    closed = make_server(api_keys=[KEY], metrics_open=False)
    assert_401(httpx.get(f"{closed.url}/metrics"))
    assert httpx.get(f"{closed.url}/metrics", headers=bearer(KEY)).status_code == 200
    assert httpx.get(f"{closed.url}/health").status_code == 200
    opened = make_server(api_keys=[KEY])
    assert httpx.get(f"{opened.url}/metrics").status_code == 200


def test_refused_requests_are_counted_without_their_keys(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(api_keys=[KEY])
    for _ in range(2):
        assert_401(httpx.post(f"{srv.v1}/chat/completions", json=CHAT, headers=bearer(WRONG)))
    metrics = httpx.get(f"{srv.url}/metrics").text
    [line] = [
        ln
        for ln in metrics.splitlines()
        if 'status="401"' in ln and ln.startswith("carousel_requests_total")
    ]
    assert line.endswith(" 2.0") and 'endpoint="chat"' in line
    assert WRONG not in metrics and KEY not in metrics


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_are_logged_only_when_enabled(
    make_server: Callable[..., LiveServer], log_prompts: bool
) -> None:
    srv = make_server(log_prompts=log_prompts)
    marker = f"private-words-{log_prompts}"
    body = {**CHAT, "messages": [{"role": "user", "content": marker}]}
    with structlog.testing.capture_logs() as logs:
        assert httpx.post(f"{srv.v1}/chat/completions", json=body).status_code == 200
        completion = {"model": SIM_MODEL, "prompt": marker, "max_tokens": 2}
        assert httpx.post(f"{srv.v1}/completions", json=completion).status_code == 200
    requests = [entry for entry in logs if entry["event"] == "request"]
    assert len(requests) == 2
    assert (marker in json.dumps(logs, default=str)) is log_prompts


def test_keys_and_prompts_never_reach_the_logs_of_carousel_serve(tmp_path: Path) -> None:
    """The real CLI at its most verbose level (`debug`), every kind of request."""
    marker = "do-not-log-this-prompt-9e2"
    flags = ("--api-key", KEY, "--log-level", "debug", "--no-metrics-open")
    with carousel_serve(tmp_path, *flags) as srv, httpx.Client(base_url=srv.url) as http:
        body = {"model": "sim", "messages": [{"role": "user", "content": marker}], "max_tokens": 3}
        for key in (WRONG, KEY):
            headers = bearer(key)
            http.post("/v1/chat/completions", json=body, headers=headers)
            http.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
            http.post("/v1/completions", json={**body, "prompt": marker}, headers=headers)
            http.post("/v1/completions", json={"model": "sim", "prompt": [marker]}, headers=headers)
            http.get("/v1/models", headers=headers)
            http.get("/metrics", headers=headers)
            http.get("/debug/trace", headers=headers)
            http.get("/nowhere", headers=headers)
            http.post("/v1/chat/completions", content=b"{not json", headers=headers)
        assert http.get("/v1/models", headers=bearer(KEY)).status_code == 200
    log = srv.log.read_text()
    statuses = [json.loads(ln)["status"] for ln in log.splitlines() if '"event": "request"' in ln]
    assert statuses.count(401) >= 4 and statuses.count(200) >= 4  # the requests were logged
    assert '"level": "debug"' in log  # debug level really was on
    assert KEY not in log and WRONG not in log
    assert marker not in log
