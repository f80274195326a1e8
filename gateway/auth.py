"""Bearer API keys for /v1/* (when any are configured); /health and /metrics stay open."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi import Request

from gateway.errors import AUTHENTICATION, APIError


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


async def require_api_key(request: Request) -> None:
    """FastAPI dependency for the /v1 router."""
    keys = request.app.state.gateway.settings.api_keys
    check_api_key(request.headers.get("authorization"), keys)
