"""The scheduler knows who sent a request (issue 48, item 6): `fair` shares service by the
API key's principal (the request's `user` only on a gateway without keys), and a key file's
`min_priority` / `min_deadline_ms` bound what a principal's requests may ask for: asking
beyond them is a 400 naming the field, and asking nothing never gets more than the cap.
Live sim servers (tests/conftest.py), one seat, so requests queue and their order shows."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from backends.sim import SimBackend
from gateway.arms.local import LocalArm
from gateway.settings.load import Settings
from schedulers.base import SchedulerConfig
from tests.conftest import SIM_MODEL, LiveServer, error_of
from tests.test_reliability_overload import wait_until
from tests.test_tenancy import auth, principals

HEADER = "X-Carousel-Deadline-Ms"
#: the heavy principal's backlog, queued before the light one's single request
BACKLOG = 6


def one_seat_arm(scheduler: str, **policy_options: object) -> LocalArm:
    """One sequence at a time, each step slept for real: waiting requests queue."""
    backend = SimBackend(num_blocks=256, max_model_len=1024, time_scale=1.0)
    config = SchedulerConfig(max_num_seqs=1)
    return LocalArm.from_backend(
        backend, scheduler=scheduler, config=config, policy_options=policy_options
    )


def chat(max_tokens: int, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": SIM_MODEL, "messages": messages, "max_tokens": max_tokens, **fields}


class Finishes:
    """Requests posted on threads; `order` lists their tags as their answers come back."""

    def __init__(self, srv: LiveServer, pool: ThreadPoolExecutor) -> None:
        self.srv, self.pool = srv, pool
        self.order: list[str] = []
        self.futures: list[Future[None]] = []
        self._lock = threading.Lock()

    def post(self, tag: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        self.futures.append(self.pool.submit(self._post, tag, body, headers))

    def _post(self, tag: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        url = f"{self.srv.v1}/chat/completions"
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        with self._lock:
            self.order.append(tag)

    def waiting(self, count: int) -> None:
        """Wait until `count` requests wait in the engine."""
        wait_until(lambda: self.srv.arm.engine.num_waiting >= count)


@contextmanager
def seat_held(srv: LiveServer, headers: dict[str, str], **fields: Any) -> Iterator[Finishes]:
    """Hold the one seat with a long stream while the body queues requests, then let it go
    (the stream closes, its request is aborted) and wait for the queued ones to finish."""
    url = f"{srv.v1}/chat/completions"
    body = chat(900, stream=True, **fields)
    with ThreadPoolExecutor(BACKLOG + 2) as pool:
        run = Finishes(srv, pool)
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60):
            wait_until(lambda: srv.arm.engine.num_running == 1)
            yield run
    for future in run.futures:
        future.result()  # NOTE: a failed request fails the test


SHARE_CASES = {  # (with API keys, the heavy sender's `user` of request i, the light one's)
    "one key rotating user is one principal": (True, lambda i: f"u{i}", "light"),
    "two keys with one user are two principals": (True, lambda i: "same", "same"),
    "without keys the user is the principal": (False, lambda i: "heavy", "light"),
}


@pytest.mark.parametrize("case", SHARE_CASES)
def test_fair_shares_service_by_the_keys_principal(
    make_server: Callable[..., LiveServer], case: str
) -> None:
    keyed, heavy_user, light_user = SHARE_CASES[case]
    settings = {"principals": principals("heavy", "light")} if keyed else {}
    srv = make_server(one_seat_arm("fair"), **settings)
    heavy = auth("heavy") if keyed else {}
    with seat_held(srv, heavy, user=heavy_user(BACKLOG)) as run:
        for i in range(BACKLOG):
            run.post("heavy", chat(4, user=heavy_user(i)), heavy)
        run.waiting(BACKLOG)
        run.post("light", chat(4, user=light_user), auth("light") if keyed else {})
        run.waiting(BACKLOG + 1)
    # FCFS (one principal per user, or one for both keys) would run the light request last
    assert run.order.index("light") <= 2, run.order


CAPS = {"min_priority": 5, "min_deadline_ms": 1000}


def test_asking_beyond_the_keys_caps_is_a_400_naming_the_field(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(principals=principals("capped", **CAPS) + principals("free"))
    url = f"{srv.v1}/chat/completions"
    asks = [({"priority": 4}, {}, "priority"), ({}, {HEADER: "999"}, HEADER)]
    for fields, headers, param in asks:
        refused = httpx.post(url, json=chat(1, **fields), headers={**auth("capped"), **headers})
        error = error_of(refused, 400)
        assert error["param"] == param and error["code"] == "beyond_principal_limit"
        assert error["type"] == "invalid_request_error" and "API key" in error["message"]
    at_cap = httpx.post(url, json=chat(1, priority=5), headers={**auth("capped"), HEADER: "1000"})
    assert at_cap.status_code == 200, at_cap.text
    uncapped = httpx.post(url, json=chat(1, priority=-100), headers={**auth("free"), HEADER: "1"})
    assert uncapped.status_code == 200, uncapped.text


FLOOR_CASES = {
    "priority": ("priority", {}, {"min_priority": 5}),
    "deadline": ("edf", {"edf_ttft_slo_ms": 10_000}, {"min_deadline_ms": 60_000}),
}


@pytest.mark.parametrize("case", FLOOR_CASES)
def test_a_capped_key_that_asks_nothing_waits_behind_an_uncapped_one(
    make_server: Callable[..., LiveServer], case: str
) -> None:
    scheduler, options, caps = FLOOR_CASES[case]
    specs = principals("capped", **caps) + principals("free")
    srv = make_server(one_seat_arm(scheduler, **options), principals=specs)
    with seat_held(srv, auth("free"), priority=-1) as run:
        run.post("capped", chat(2), auth("capped"))  # first come, yet it asked for nothing
        run.waiting(1)
        run.post("free", chat(2), auth("free"))
        run.waiting(2)
    assert run.order == ["free", "capped"]


def test_a_responses_body_cannot_set_a_priority(make_server: Callable[..., LiveServer]) -> None:
    # `priority` is not a Responses API field: an unknown one is ignored, never scheduled by
    srv = make_server(one_seat_arm("priority"))
    body = {"model": SIM_MODEL, "input": "Hi", "max_output_tokens": 2, "priority": "urgent"}
    for _ in range(2):
        response = httpx.post(f"{srv.v1}/responses", json=body, timeout=30)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"name": "anonymous"}, "name"),
        ({"name": "ok", "min_deadline_ms": 0}, "min_deadline_ms"),
        ({"name": "ok", "min_priority": 2**31}, "min_priority"),
    ],
)
def test_a_key_file_entry_with_a_reserved_name_or_a_bad_cap_is_refused(
    entry: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError) as info:
        Settings(backend="sim", principals=[{"keys": ["sk-secret-value"], **entry}])
    assert field in str(info.value) and "sk-secret-value" not in str(info.value)
