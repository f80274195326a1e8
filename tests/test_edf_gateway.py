"""`edf` over HTTP: the `X-Carousel-Deadline-Ms` header reaches the scheduler (a bad value is
a 400 naming it), and under `edf_late=refuse` a request that cannot start in time is an
OpenAI-shaped 429 `deadline_exceeded`; on a gateway without keys the `user` field reaches the
scheduler as the principal (tests/test_fair_gateway.py: with keys, the key's principal)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from backends.sim import SimBackend
from gateway.api.pipeline import ServingOptions
from gateway.arms.local import LocalArm
from schedulers.base import SchedulerConfig
from schedulers.sequence import DEADLINE_EXCEEDED
from tests.conftest import CHAT, LiveServer, error_of
from tests.test_reliability_overload import assert_all_blocks_free, wait_until

HEADER = "X-Carousel-Deadline-Ms"


def edf_arm(**policy_options: object) -> LocalArm:
    backend = SimBackend(num_blocks=256, max_model_len=1024, time_scale=1.0)
    return LocalArm.from_backend(
        backend,
        scheduler="edf",
        config=SchedulerConfig(max_num_seqs=1),
        policy_options=policy_options,
        options=ServingOptions(retry_after_s=2),
    )


def test_a_bad_deadline_header_is_a_400_naming_it(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(edf_arm())
    for bad in ("soon", "0", "-5", "inf"):
        response = httpx.post(f"{srv.v1}/chat/completions", json=CHAT, headers={HEADER: bad})
        assert error_of(response, 400)["param"] == HEADER


def test_a_request_that_cannot_start_by_its_deadline_is_a_429(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(edf_arm(edf_late="refuse"))
    url = f"{srv.v1}/chat/completions"
    long = {**CHAT, "max_tokens": 600, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=long) as running:
        wait_until(lambda: srv.arm.engine.num_running == 1)
        started = time.monotonic()
        refused = http.post(url, json=CHAT, headers={HEADER: "200"})
        assert time.monotonic() - started < 3.0
        error = error_of(refused, 429)
        assert error["code"] == DEADLINE_EXCEEDED and error["type"] == "rate_limit_error"
        assert "200 ms deadline" in error["message"]
        assert refused.headers["retry-after"] == "2"
        assert srv.arm.engine.num_running == 1
        next(line for line in running.iter_lines() if line.startswith("data: {"))
    assert_all_blocks_free(srv)


def test_the_request_user_and_deadline_reach_the_scheduler_without_keys(
    make_server: Callable[..., LiveServer],
) -> None:
    srv = make_server(edf_arm())
    seen: list[tuple[str | None, float | None]] = []
    scheduler = srv.arm.engine.scheduler
    add = scheduler.add

    def spy(seq: object) -> None:
        params = seq.sampling_params  # type: ignore[attr-defined]
        seen.append((params.principal, params.deadline_ms))
        add(seq)  # type: ignore[arg-type]

    scheduler.add = spy  # type: ignore[method-assign]
    body = {**CHAT, "user": "alice"}
    response = httpx.post(f"{srv.v1}/chat/completions", json=body, headers={HEADER: "1500"})
    assert response.status_code == 200, response.text
    assert seen == [("alice", 1500.0)]
