"""Pure ASGI middleware: request ids and the request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through
untouched.
"""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import INVALID_REQUEST, APIError

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


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes`: by Content-Length up front, else while read.

    A body that grows past the limit raises `APIError(413)` from `receive`, inside whatever
    is reading it (the route), whose error handler then answers.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await body_too_large(self.limit).response()(scope, receive, send)
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
