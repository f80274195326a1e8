"""Bearer API keys (when any are configured) on every route but the open ones, and who sent
each request.

`APIKeyMiddleware` guards the whole app (so a route added later is guarded by default);
/health is always open, /metrics when `metrics_open`. A key resolves to its principal
(gateway/settings/principals.py), which the middleware puts in the request's state
(`request.state.principal`): the routes pass it on, never the key. Keys are looked up by
their SHA-256 digest and confirmed in constant time, and never logged: only that a key was
missing or wrong. A principal's `max_in_flight` is enforced here, around the whole request
(a stream counts until its last byte).
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from collections.abc import Collection, Iterable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.errors import AUTHENTICATION, RATE_LIMIT, APIError
from gateway.http.middleware import OnRefused, refuse
from gateway.settings.principals import ANONYMOUS, Principal


def _unauthorized(message: str) -> APIError:
    return APIError(
        401, message, AUTHENTICATION, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyTable:
    """API keys -> principals, held as digests (the keys themselves are not kept)."""

    def __init__(self, pairs: Iterable[tuple[str, Principal]]) -> None:
        self._by_digest = {_digest(key): principal for key, principal in pairs}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def resolve(self, authorization: str | None) -> Principal:
        """The principal of `Bearer <key>`; 401 for a missing or unknown key (anonymous when
        no key is configured)."""
        if not self._by_digest:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized(
                "You didn't provide an API key. Provide it in an Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        given = _digest(token)
        for digest, principal in self._by_digest.items():
            # NOTE: every digest is compared, so timing says nothing about which one matched
            if hmac.compare_digest(given, digest):
                found = principal
                break
        else:
            raise _unauthorized("Incorrect API key provided.")
        return found


def request_principal(request: Request) -> Principal:
    """Who sent `request` (set by `APIKeyMiddleware`; anonymous on an open route)."""
    principal = getattr(request.state, "principal", None)
    return principal if isinstance(principal, Principal) else ANONYMOUS


class APIKeyMiddleware:
    """401 `invalid_api_key` for any request outside `open_paths` without a valid key; 429
    beyond a principal's `max_in_flight`; otherwise the principal goes in the request state."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyTable,
        open_paths: Collection[str] = ("/health",),
        on_refused: OnRefused | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            principal = self.keys.resolve(Headers(scope=scope).get("authorization"))
            self._check_in_flight(principal)
        except APIError as exc:
            await refuse(exc, scope, receive, send, self.on_refused)
            return
        scope.setdefault("state", {})["principal"] = principal
        self.in_flight[principal.name] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[principal.name] -= 1
            if not self.in_flight[principal.name]:
                del self.in_flight[principal.name]

    def _check_in_flight(self, principal: Principal) -> None:
        limit = principal.max_in_flight
        if limit is not None and self.in_flight[principal.name] >= limit:
            raise APIError(
                429,
                f"Too many requests in flight for this API key (at most {limit} at once).",
                RATE_LIMIT,
                None,
                "too_many_requests_in_flight",
            )
