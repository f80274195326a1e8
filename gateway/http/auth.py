"""Bearer API keys (when any are configured) on every route but the open ones.

`APIKeyMiddleware` guards the whole app (so a route added later is guarded by default);
/health is always open, /metrics when `metrics_open`. Keys are compared in constant time
and never logged: only that a key was missing or wrong.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.errors import AUTHENTICATION, APIError
from gateway.http.middleware import OnRefused, refuse


def _unauthorized(message: str) -> APIError:
    return APIError(
        401, message, AUTHENTICATION, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
    )


def check_api_key(authorization: str | None, keys: Sequence[str]) -> None:
    """Raise 401 unless `authorization` is `Bearer <one of keys>` (no-op without keys)."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized(
            "You didn't provide an API key. Provide it in an Authorization header "
            "(Authorization: Bearer YOUR_KEY)."
        )
    given = token.encode("utf-8")
    matched = False
    for key in keys:  # NOTE: compare against every key, so timing says nothing about which
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    if not matched:
        raise _unauthorized("Incorrect API key provided.")


class APIKeyMiddleware:
    """401 `invalid_api_key` for any request outside `open_paths` without a valid key."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[str],
        open_paths: Collection[str] = ("/health",),
        on_refused: OnRefused | None = None,
    ) -> None:
        self.app = app
        self.keys = list(keys)
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            check_api_key(Headers(scope=scope).get("authorization"), self.keys)
        except APIError as exc:
            await refuse(exc, scope, receive, send, self.on_refused)
            return
        await self.app(scope, receive, send)
