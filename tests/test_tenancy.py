"""Tenancy (issue 38): API keys resolve to principals, stored responses belong to theirs,
one key cannot evict another's, client values are bounded, and clients pin only the arms
they may. Live sim servers (tests/conftest.py), in memory and on a shared real Redis."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from backends.upstream import UpstreamConfig
from gateway.app import create_app
from gateway.arms.choice import ARM_HEADER
from gateway.arms.deployment import Deployment
from gateway.arms.upstream import UpstreamArm
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, LiveServer, error_of, serve_app, sim_arm

Principals = list[dict[str, Any]]
#: one pair more than OpenAI's limit
SEVENTEEN_PAIRS = {f"k{i}": "v" for i in range(17)}


def principals(*names: str, **limits: Any) -> Principals:
    """One principal per name, keyed `key-of-<name>`; `limits` apply to the first."""
    specs: Principals = [{"name": n, "keys": [f"key-of-{n}"]} for n in names]
    specs[0].update(limits)
    return specs


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-of-{name}"}


def create(url: str, name: str, **body: Any) -> dict[str, Any]:
    body = {"model": SIM_MODEL, "input": "My name is Ada.", "max_output_tokens": 2, **body}
    response = httpx.post(f"{url}/v1/responses", json=body, headers=auth(name), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def unique(*names: str) -> list[str]:
    """Principal names no other test (or earlier run on the same Redis) has used."""
    tag = uuid.uuid4().hex[:8]
    return [f"{n}-{tag}" for n in names]


def replicas(
    make_server: Callable[..., LiveServer], store: str, redis_url: str, **settings: Any
) -> tuple[str, str]:
    """Two gateway URLs: one app twice (memory) or two apps sharing one Redis."""
    if store == "memory":
        url = make_server(sim_arm(), **settings).url
        return url, url
    first = make_server(sim_arm(), redis_url=redis_url, **settings)
    second = make_server(sim_arm(), redis_url=redis_url, **settings)
    return first.url, second.url


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(store: str, request: pytest.FixtureRequest) -> str:
    """The `redis_url` fixture only for the redis case (the memory case needs no server)."""
    return "" if store == "memory" else str(request.getfixturevalue("redis_url"))


def test_another_key_gets_404_on_a_stored_response_through_every_route(
    make_server: Callable[..., LiveServer], store: str, store_url: str
) -> None:
    a, b = unique("a", "b")
    here, there = replicas(make_server, store, store_url, principals=principals(a, b))
    made = create(here, a)
    rid = made["id"]
    for method, path in [
        ("GET", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{rid}/input_items"),
        ("DELETE", f"/v1/responses/{rid}"),
    ]:
        error = error_of(httpx.request(method, there + path, headers=auth(b)), 404)
        assert error["param"] == "response_id" and "Ada" not in error["message"]
    follow = {"model": SIM_MODEL, "input": "Who am I?", "previous_response_id": rid}
    error = error_of(httpx.post(f"{there}/v1/responses", json=follow, headers=auth(b)), 404)
    assert error["param"] == "previous_response_id"
    # A's response is untouched, and A continues it on the other replica
    got = httpx.get(f"{there}/v1/responses/{rid}", headers=auth(a))
    assert got.status_code == 200 and got.json()["id"] == rid
    items = httpx.get(f"{there}/v1/responses/{rid}/input_items", headers=auth(a)).json()
    assert items["data"][0]["content"][0]["text"] == "My name is Ada."
    second = create(there, a, input="Who am I?", previous_response_id=rid)
    assert second["usage"]["input_tokens"] > made["usage"]["input_tokens"]
    assert httpx.delete(f"{here}/v1/responses/{rid}", headers=auth(a)).status_code == 200
    error_of(httpx.get(f"{there}/v1/responses/{rid}", headers=auth(a)), 404)


def test_one_keys_traffic_cannot_evict_another_keys_response(
    make_server: Callable[..., LiveServer], store: str, store_url: str
) -> None:
    flood, quiet = unique("flood", "quiet")
    here, there = replicas(
        make_server,
        store,
        store_url,
        principals=principals(flood, quiet),
        responses_store_max_bytes=64 * 1024,
    )
    kept = create(here, quiet)["id"]
    metadata = {f"k{i}": "v" * 512 for i in range(16)}  # as large as the bounds allow
    floods = [create(there, flood, metadata=metadata)["id"] for _ in range(12)]
    assert httpx.get(f"{here}/v1/responses/{kept}", headers=auth(quiet)).status_code == 200
    # the flood evicted its own oldest responses, within its own share
    assert httpx.get(f"{here}/v1/responses/{floods[0]}", headers=auth(flood)).status_code == 404
    assert httpx.get(f"{here}/v1/responses/{floods[-1]}", headers=auth(flood)).status_code == 200


def test_an_unreachable_redis_is_a_503_for_lookups_and_answers_still_come(
    make_server: Callable[..., LiveServer],
) -> None:
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = make_server(sim_arm(), response_store=f"redis://127.0.0.1:{port}/0").url
    made = httpx.post(
        f"{url}/v1/responses",
        json={"model": SIM_MODEL, "input": "Hi", "max_output_tokens": 1},
        timeout=30,
    )
    assert made.status_code == 200, made.text  # not stored, but answered
    lookup = httpx.get(f"{url}/v1/responses/{made.json()['id']}", timeout=30)
    assert error_of(lookup, 503)["code"] == "store_unavailable"
    assert "Retry-After" in lookup.headers


def test_a_keys_own_stored_bytes_limit_is_its_share(
    make_server: Callable[..., LiveServer],
) -> None:
    url = make_server(sim_arm(), principals=principals("small", max_stored_bytes=4096)).url
    first = create(url, "small")["id"]
    create(url, "small", metadata={"note": "x" * 512, "more": "y" * 512})
    create(url, "small", metadata={"note": "x" * 512, "more": "y" * 512})
    error_of(httpx.get(f"{url}/v1/responses/{first}", headers=auth("small")), 404)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": "Hi", "metadata": {"blob": "x" * (3_500_000)}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": SEVENTEEN_PAIRS}, "metadata"),
        ("/v1/responses", {"input": "Hi", "metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "user": "u" * 257}, "user"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "metadata": {"blob": "x" * 3_500_000}}, "metadata"),
        ("/v1/completions", {"prompt": "Hi", "user": "u" * 257}, "user"),
    ],
)  # fmt: skip
def test_oversized_metadata_and_user_are_400s_naming_them(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(server.url + path, json={"model": SIM_MODEL, **body}, timeout=30)
    error = error_of(response, 400)
    assert error["param"] == param and len(error["message"]) < 300


def test_the_access_log_names_each_requests_principal_never_its_key(
    make_server: Callable[..., LiveServer],
) -> None:
    url = make_server(principals=principals("ada", "bob")).url
    with structlog.testing.capture_logs() as logs:
        for name in ("ada", "bob", "ada"):
            create(url, name)
    requests = [entry for entry in logs if entry["event"] == "request"]
    assert [entry["principal"] for entry in requests] == ["ada", "bob", "ada"]
    assert "key-of-" not in json.dumps(logs, default=str)


def test_a_long_input_string_is_one_item(make_server: Callable[..., LiveServer]) -> None:
    url = make_server(sim_arm(max_model_len=8192, num_blocks=1024)).url
    body = {"model": SIM_MODEL, "input": "word " * 1000, "max_output_tokens": 1}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text


@pytest.fixture
def pinning_url() -> Iterator[str]:
    """A deployment with a weighted arm `main`, zero-weight arms `dark` and `open` (this one
    `pinnable`) and a shadow `mirror`; keys `plain` and `trusted` (allowed main and dark)."""
    arms = {name: sim_arm() for name in ("main", "dark", "open", "mirror")}
    for name, arm in arms.items():
        arm.name = name
        arm.weight = 1.0 if name == "main" else 0.0
    arms["open"].pinnable = True
    arms["mirror"].shadow = True
    specs = principals("plain") + principals("trusted", allowed_arms=["main", "dark"])
    app = create_app(
        Settings(backend="sim", served_model_name=SIM_MODEL, principals=specs),
        [Deployment(SIM_MODEL, list(arms.values()))],
    )
    with serve_app(app) as url:
        yield url


def pin(url: str, name: str, arm: str) -> httpx.Response:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    headers = {**auth(name), ARM_HEADER: arm}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_clients_pin_only_the_arms_they_may(pinning_url: str) -> None:
    assert pin(pinning_url, "plain", "main").status_code == 200
    assert pin(pinning_url, "plain", "open").status_code == 200  # zero weight, pinnable
    refused = error_of(pin(pinning_url, "plain", "dark"), 403)
    assert refused["code"] == "arm_not_pinnable" and refused["param"] == ARM_HEADER
    assert refused["type"] == "permission_error"
    for name in ("plain", "trusted"):  # a shadow is not there for clients, not even by name
        hidden = error_of(pin(pinning_url, name, "mirror"), 400)
        assert (
            hidden["code"] == "arm_not_found" and "mirror" not in hidden["message"].split(":")[-1]
        )
    assert pin(pinning_url, "trusted", "dark").status_code == 200  # its allowed arms
    assert error_of(pin(pinning_url, "trusted", "open"), 403)["code"] == "arm_not_pinnable"


def test_a_key_beyond_its_requests_in_flight_gets_429_until_one_ends(
    make_server: Callable[..., LiveServer],
) -> None:
    specs = principals("busy", max_in_flight=1) + principals("other")
    url = make_server(sim_arm(time_scale=50.0), principals=specs).url
    chat = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    slow = {**chat, "max_tokens": 60, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=slow, headers=auth("busy"), timeout=60
    ) as stream:
        chunks = stream.iter_bytes()
        next(chunks)  # it is being served (NOTE: kept: a dropped iterator closes the stream)
        quick = {**chat, "max_tokens": 1}
        refused = httpx.post(f"{url}/v1/chat/completions", json=quick, headers=auth("busy"))
        error = error_of(refused, 429)
        assert (
            error["code"] == "too_many_requests_in_flight" and error["type"] == "rate_limit_error"
        )
        other = httpx.post(f"{url}/v1/chat/completions", json=quick, headers=auth("other"))
        assert other.status_code == 200  # another key's share is its own
    deadline = time.monotonic() + 20
    while True:  # the disconnect ends the stream, and with it the count
        again = httpx.post(f"{url}/v1/chat/completions", json=quick, headers=auth("busy"))
        if again.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert again.status_code == 200, again.text


def test_another_key_gets_404_on_an_upstream_arms_response(
    make_server: Callable[..., LiveServer],
) -> None:
    remote = make_server(sim_arm())
    upstream = UpstreamArm("remote", UpstreamConfig(base_urls=(remote.v1,), model=SIM_MODEL))
    app = create_app(
        Settings(backend="sim", served_model_name="front", principals=principals("a", "b")),
        [Deployment("front", [upstream])],
    )
    with serve_app(app) as url:
        body = {"model": "front", "input": "My name is Ada.", "max_output_tokens": 2}
        made = httpx.post(f"{url}/v1/responses", json=body, headers=auth("a")).json()
        rid = made["id"]
        for method, path in [
            ("GET", f"/v1/responses/{rid}"),
            ("GET", f"/v1/responses/{rid}/input_items"),
            ("DELETE", f"/v1/responses/{rid}"),
        ]:
            error_of(httpx.request(method, url + path, headers=auth("b")), 404)
        follow = {**body, "previous_response_id": rid}
        error = error_of(httpx.post(f"{url}/v1/responses", json=follow, headers=auth("b")), 404)
        assert error["param"] == "previous_response_id"
        assert httpx.get(f"{url}/v1/responses/{rid}", headers=auth("a")).status_code == 200
    assert httpx.get(f"{remote.v1}/responses/{rid}").status_code == 200  # still upstream


def test_api_keys_come_from_a_file_named_by_the_environment(
    make_server: Callable[..., LiveServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("- name: filed\n  keys: [key-of-filed]\n  max_in_flight: 4\n")
    monkeypatch.setenv("CAROUSEL_API_KEY_FILE", str(keys))
    url = make_server(sim_arm()).url
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("filed"))
    assert ok.status_code == 200, ok.text
    wrong = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("nobody"))
    assert error_of(wrong, 401)["code"] == "invalid_api_key"


def test_a_bad_key_file_is_refused_without_showing_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("principals:\n  - name: good\n    keys: [sk-good]\n")
    [(_, good)] = Settings(backend="sim", api_key_file=str(keys)).key_principals()
    assert good.name == "good"
    keys.write_text("- name: bad name!\n  keys: [sk-very-secret-value]\n")
    with pytest.raises(ValueError) as info:
        Settings(backend="sim", api_key_file=str(keys))
    assert "sk-very-secret-value" not in str(info.value) and "name" in str(info.value)
    keys.write_text("- name: one\n  keys: [sk-same]\n- name: two\n  keys: [sk-same]\n")
    with pytest.raises(ValueError) as info:
        Settings(backend="sim", api_key_file=str(keys))
    assert "sk-same" not in str(info.value)


def test_a_bare_api_key_is_a_principal_named_without_the_secret() -> None:
    settings = Settings(backend="sim", api_keys=["sk-the-secret"])
    [(key, principal)] = settings.key_principals()
    assert key == "sk-the-secret" and principal.name.startswith("key-")
    assert "secret" not in principal.name and len(principal.name) == len("key-") + 8


def test_principals_come_from_the_config_file_with_their_limits(tmp_path: Path) -> None:
    config = tmp_path / "carousel.yaml"
    config.write_text(
        "backend: sim\n"
        "principals:\n"
        "  - name: team-a\n"
        "    keys: [sk-a-1, sk-a-2]\n"
        "    allowed_arms: [main]\n"
        "    max_in_flight: 3\n"
        "    max_stored_bytes: 4096\n"
    )
    settings = Settings.load(config)
    pairs = settings.key_principals()
    assert [key for key, _ in pairs] == ["sk-a-1", "sk-a-2"]
    team = pairs[0][1]
    assert team.name == "team-a" and team.allowed_arms == frozenset({"main"})
    assert (team.max_in_flight, team.max_stored_bytes) == (3, 4096)
    assert "sk-a-1" not in repr(settings)
