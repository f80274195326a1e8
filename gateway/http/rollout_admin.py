"""`/admin/rollout`: a rollout's status, and an operator's pause, resume, abort or promote.

With `admin_api_keys` configured, or a principal with `admin: true`, these routes need an
admin: one of those keys or that principal's (any API key passes the app's middleware
first); with neither, whatever the middleware lets through may call them.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request

from gateway.api.errors import APIError, invalid
from gateway.http.auth import request_principal
from gateway.rollout.controller import RolloutController
from gateway.state import GatewayState

rollout_admin = APIRouter(prefix="/admin/rollout")


def check_admin(request: Request, state: GatewayState) -> None:
    """403 unless the request comes from an admin: an `admin: true` principal or a key of
    `admin_api_keys` (no-op when neither is configured)."""
    admin_keys = state.settings.admin_api_keys
    if request_principal(request).admin or not (admin_keys or state.admin_principals):
        return
    _, _, token = (request.headers.get("authorization") or "").partition(" ")
    given = token.strip().encode("utf-8")
    matched = False
    for key in admin_keys:  # NOTE: every key compared, so timing says nothing about which
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    if not matched:
        raise APIError(
            403, "This route needs an admin API key.", "permission_error", None, "not_admin"
        )


def _rollout(request: Request, model: str | None) -> RolloutController:
    state: GatewayState = request.app.state.gateway
    check_admin(request, state)
    if not state.rollouts:
        raise APIError(
            404, "No rollout is configured.", "invalid_request_error", None, "no_rollout"
        )
    if model is None:
        return next(iter(state.rollouts.values()))
    if model not in state.rollouts:
        known = ", ".join(state.rollouts)
        raise invalid(f"No rollout for model `{model}`; rollouts: {known}.", param="model")
    return state.rollouts[model]


@rollout_admin.get("")
async def rollout_status(request: Request, model: str | None = None) -> dict[str, Any]:
    return _rollout(request, model).status()


@rollout_admin.post("/{action}")
async def rollout_command(
    request: Request, action: str, model: str | None = None
) -> dict[str, Any]:
    rollout = _rollout(request, model)
    try:
        rollout.command(action)
    except ValueError as exc:
        raise invalid(str(exc), param="action", code="rollout_action_refused") from None
    return rollout.status()
