"""Pure ASGI middleware: request ids, draining, and the request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through
untouched. A middleware that refuses a request answers it itself (exception handlers only
see what the router raises) and reports it through `OnRefused`, so the app can log and
count it like any other request.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Collection

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import INVALID_REQUEST, APIError, shutting_down

#: called with (scope, status, message) for each request a middleware refused
OnRefused = Callable[[Scope, int, str], None]

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Takes `X-Request-Id` (if sane) or makes one; stores it in `request.state.request_id`
    and echoes it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        accepted = _VALID_REQUEST_ID.fullmatch(given) is not None
        request_id = given if accepted else new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        # NOTE: clients may reuse ids; the engine needs one unique per request in flight.
        state["engine_request_id"] = f"{given}-{uuid.uuid4().hex[:8]}" if accepted else request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than the {limit} bytes this server accepts.",
        INVALID_REQUEST,
        None,
        "request_too_large",
    )


async def refuse(
    error: APIError, scope: Scope, receive: Receive, send: Send, on_refused: OnRefused | None
) -> None:
    """Answer `error` from a middleware, reporting it first."""
    if on_refused is not None:
        on_refused(scope, error.status_code, error.message)
    await error.response()(scope, receive, send)


class Admission:
    """Counts the HTTP requests in flight; once `draining`, new ones are refused."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True


class DrainMiddleware:
    """Tracks requests in flight; while draining, answers new ones 503 `server_shutting_down`
    (with `Connection: close`), except on `open_paths` (/metrics, for a last scrape)."""

    def __init__(
        self,
        app: ASGIApp,
        admission: Admission,
        retry_after_s: int = 1,
        open_paths: Collection[str] = ("/metrics",),
        on_refused: OnRefused | None = None,
    ) -> None:
        self.app = app
        self.admission = admission
        self.retry_after_s = retry_after_s
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.admission.draining and scope["path"] not in self.open_paths:
            error = shutting_down(self.retry_after_s)
            error.headers["Connection"] = "close"
            await refuse(error, scope, receive, send, self.on_refused)
            return
        self.admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.in_flight -= 1


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes`: by Content-Length up front, else while read.

    A body that grows past the limit raises `APIError(413)` from `receive`, inside whatever
    is reading it (the route), whose error handler then answers.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, on_refused: OnRefused | None = None
    ) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await refuse(body_too_large(self.limit), scope, receive, send, self.on_refused)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise body_too_large(self.limit)
            return message

        await self.app(scope, limited_receive, send)
