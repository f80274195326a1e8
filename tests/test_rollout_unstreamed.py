"""Unstreamed replies of upstream arms feed the rollout's e2e tests.

An upstream arm learns a request's TTFT and TPOT only from a stream, but its end-to-end
latency from any reply: the gateway times every request from arrival to the last byte of its
answer (gateway/services.py `finish`). So a rollout whose target is `e2e_p50` decides on
unstreamed traffic alone. Here the topology of docs/rollout.md runs in one process: two sim
servers (the candidate three times faster) behind a gateway with upstream arms.
"""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from gateway.app import create_app
from gateway.settings.load import Settings
from tests.conftest import SIM_MODEL, serve_app, sim_arm, start_server

MAX_REQUESTS = 400


def test_unstreamed_replies_decide_an_e2e_target_on_upstream_arms() -> None:
    with ExitStack() as stack:
        slow = start_server(stack, sim_arm(time_scale=3.0))
        fast = start_server(stack, sim_arm(time_scale=1.0))
        settings = Settings(
            backend="sim",
            served_model_name="m",
            arms=[  # type: ignore[list-item]
                {"name": name, "upstream": {"base_urls": [server.v1], "model": SIM_MODEL}}
                for name, server in (("baseline", slow), ("candidate", fast))
            ],
            rollout={  # type: ignore[arg-type]
                "baseline": "baseline",
                "candidate": "candidate",
                "steps": [50, 100],
                "metric": "e2e_p50",
                "guardrails": {"error_rate": 0.05, "e2e_p50": 0.10},
                "min_requests": 20,
                "requests_per_unit": 1,
            },
        )
        url = stack.enter_context(serve_app(create_app(settings)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(MAX_REQUESTS):
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                status = client.get("/admin/rollout").json()
                if status["status"] != "running":
                    break
    assert status["status"] == "promoted", status
    [decision] = status["decisions"]
    assert (decision["kind"], decision["reason"]) == ("advance", "target"), decision
    assert min(decision["n"].values()) >= 20
    print(f"promoted on e2e_p50 after unstreamed requests {decision['n']}")
