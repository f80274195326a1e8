"""One Redis setting (issue 52): `redis_url` (`--redis-url`, `CAROUSEL_REDIS_URL`, YAML) is
where the Responses store and the rollout state live; `response_store` and `rollout_store`
still work alone, and where given (by any source) each wins for its own store."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from gateway.api.responses.redis_store import RedisResponseStore
from gateway.app import create_app
from gateway.cli import build_parser, load_settings, main
from gateway.rollout.store import RedisRolloutStore, open_store
from gateway.settings.load import Settings

URL = "redis://127.0.0.1:6379/3"


def settings_from(argv: list[str]) -> Settings:
    return load_settings(build_parser().parse_args(["serve", *argv]))


def test_redis_url_alone_is_where_both_shared_stores_live() -> None:
    settings = settings_from(["--backend", "sim", "--redis-url", URL])
    assert (settings.response_store, settings.rollout_store) == (URL, URL)
    assert isinstance(open_store(settings.rollout_store, "m"), RedisRolloutStore)


def test_without_redis_url_both_stores_stay_in_memory() -> None:
    settings = settings_from(["--backend", "sim"])
    assert (settings.response_store, settings.rollout_store) == ("memory", None)


def test_the_old_settings_alone_work_as_before(tmp_path: Path) -> None:
    responses = settings_from(["--backend", "sim", "--response-store", URL])
    assert (responses.response_store, responses.rollout_store) == (URL, None)
    state = str(tmp_path / "rollout.json")
    rollout = settings_from(["--backend", "sim", "--rollout-store", state])
    assert (rollout.response_store, rollout.rollout_store) == ("memory", state)


def test_a_stores_own_setting_wins_over_redis_url_from_any_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = str(tmp_path / "rollout.json")
    config = tmp_path / "c.yaml"
    config.write_text(f"rollout_store: {state}\n")
    monkeypatch.setenv("CAROUSEL_REDIS_URL", URL)
    settings = settings_from(["--backend", "sim", "--config", str(config)])
    assert (settings.response_store, settings.rollout_store) == (URL, state)
    other = "redis://127.0.0.1:6379/4"
    monkeypatch.setenv("CAROUSEL_RESPONSE_STORE", other)
    settings = settings_from(["--backend", "sim", "--redis-url", URL])
    assert (settings.response_store, settings.rollout_store) == (other, URL)


def test_a_redis_url_from_yaml_reaches_both(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"redis-url: {URL}\n")
    settings = settings_from(["--backend", "sim", "--config", str(config)])
    assert (settings.response_store, settings.rollout_store) == (URL, URL)


def test_a_redis_url_that_is_no_url_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--backend", "sim", "--redis-url", "localhost:6379"]) == 2
    err = capsys.readouterr().err
    assert "redis_url must be a redis://host:port/db" in err
    assert "response_store" not in err  # one problem, named once


def test_the_app_keeps_responses_in_the_redis_url(redis_url: str) -> None:
    app = create_app(Settings(backend="sim", redis_url=redis_url))
    store = app.state.gateway.response_store
    assert isinstance(store, RedisResponseStore)
    response_id = f"resp_{uuid.uuid4().hex}"

    async def put_here_get_there() -> bool:
        shared = RedisResponseStore(redis_url, 8, 1 << 20, {})
        try:
            await store.put(response_id, {"id": response_id, "output": []}, [])
            return await shared.get(response_id) is not None
        finally:
            await store.close()
            await shared.close()

    assert asyncio.run(put_here_get_there())
