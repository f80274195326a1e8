"""Upstream arms: proxy OpenAI requests to OpenAI-compatible servers (vLLM, the OpenAI API,
another Carousel) over a pooled httpx client. Independent of gateway internals.

API
---
``UpstreamConfig(base_urls, model, api_key=None, connect_timeout_s=5.0, read_timeout_s=600.0,
health_interval_s=10.0, max_connections=256, retries=2)``
    Frozen. `base_urls` are replicas of one upstream, each ending where OpenAI paths begin
    (``"http://127.0.0.1:8001/v1"``); `model` replaces the request's ``model``; `api_key`
    is sent as a Bearer token and never logged; `read_timeout_s` bounds each read;
    `retries` extra replicas are tried after a connect error or a 5xx before the first
    byte; `health_interval_s <= 0` disables the background health checks.

``UpstreamClient(config, transport=None)``
    ``await start()`` / ``await close()`` (or ``async with``).
    ``await complete(path, body, headers=None) -> (status, json_dict)`` for a 2xx reply.
    ``stream(path, body, headers=None)`` is an async generator of raw SSE frames
    (``b"data: {...}\\n\\n"``), each yielded as soon as it arrives and always ending with
    exactly one ``b"data: [DONE]\\n\\n"``. ``aclose()`` or cancellation closes the upstream
    response at once.
    ``await check_health()`` probes every replica once (the background task's step).
    ``replicas -> list[ReplicaState]``: snapshots of ``url`` (credentials and query
    stripped), ``healthy``, ``outstanding``, ``failures`` (consecutive).

    `path` is relative to the base URL (``"/chat/completions"``, ``"/completions"``);
    `body` is the parsed JSON request, copied with ``model`` rewritten (and ``stream`` set
    for `stream`, dropped with ``stream_options`` for `complete`). Of `headers`, only
    X-Request-Id is forwarded.

Replica choice: least outstanding requests among healthy replicas, ties round robin; if
no untried replica is healthy the unhealthy ones are tried anyway. A connect error,
connect timeout, connection dropped before the response, or a 5xx before the first byte
marks the replica unhealthy and moves to another; any other answer marks it healthy.
The health task probes ``GET {base}/models``, then ``GET {host}/health``, every
`health_interval_s` and restores (or takes down) replicas.

``UpstreamError(status, message, type="server_error", param=None, code=None)``
    ``.to_dict() -> {"error": {"message", "type", "param", "code"}}``, ``.to_sse()``.
    Raised by `complete`, and by `stream` before its first frame:

    ===================================================  ======  =========================
    failure                                              status  code
    ===================================================  ======  =========================
    every replica tried was unreachable                   503     upstream_unavailable
    replicas tried answered 5xx (at least one)            502     upstream_unavailable
    our own connection pool exhausted (pool timeout)      503     upstream_unavailable
    no response / no next chunk within read_timeout_s     504     upstream_timeout
    non-JSON body, not an SSE stream, dropped mid-body    502     upstream_bad_response
    upstream 401/403 (the gateway's key was refused)      502     upstream_auth_failed
    other upstream 4xx                                    its own its own (never retried)
    ===================================================  ======  =========================

    After a stream's first frame, the same errors arrive in-band as
    ``data: {"error": {...}}`` followed by ``data: [DONE]``. Messages never carry
    tracebacks, API keys or replica URLs (those go to structlog, redacted).
"""

from backends.upstream.client import UpstreamClient
from backends.upstream.config import UpstreamConfig
from backends.upstream.errors import UpstreamError
from backends.upstream.replicas import ReplicaState
from backends.upstream.sse import DONE_FRAME, SSEParseError, SSEParser

__all__ = [
    "DONE_FRAME",
    "ReplicaState",
    "SSEParseError",
    "SSEParser",
    "UpstreamClient",
    "UpstreamConfig",
    "UpstreamError",
]
