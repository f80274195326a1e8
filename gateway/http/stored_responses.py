"""Stored Responses API responses by id: `GET` and `DELETE /v1/responses/{id}`, and
`GET /v1/responses/{id}/input_items`.

A response a local arm served is in the gateway's `ResponseStore`; one an upstream arm
forwarded lives on its upstream (under the upstream's id), so these are sent to the arm the
store noted as its creator. Both are the requesting principal's only: any other principal
gets a 404, and an id this gateway did not note for the principal is never asked of an
upstream (whose store the gateway reaches with its own credentials). (`previous_response_id`
is checked and routed the same way, in routes.py.)
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from gateway.api.errors import APIError, invalid, not_found
from gateway.api.outputs.plan import problem_error
from gateway.api.problems import ParamProblem
from gateway.api.responses.input_items import DEFAULT_LIMIT, input_items_page
from gateway.api.responses.protocol import deleted_body
from gateway.api.responses.store import StoredResponse
from gateway.http.auth import request_principal
from gateway.state import GatewayState

stored_responses = APIRouter(prefix="/v1")
#: what a response id may be made of before it is put into an upstream's URL
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def _not_found(response_id: str) -> APIError:
    return not_found(f"Response with id '{response_id}' not found.", "response_id")


async def _from_arms(
    state: GatewayState,
    principal: str,
    response_id: str,
    method: str,
    suffix: str = "",
    **params: str,
) -> dict[str, Any] | None:
    """The answer of the upstream arm that created `response_id` for `principal` (noted
    when it was created); None when the gateway's store holds it. A 404 naming `response_id`
    when `principal` has no such response: an id is never looked for upstream on a guess."""
    if not _RESPONSE_ID.fullmatch(response_id):
        raise _not_found(response_id)
    store = state.response_store
    owner = await store.owner(response_id, principal)
    if owner is None:
        await _stored(state, principal, response_id)
        return None
    for deployment, arm in state.deployments.arms():
        if (deployment.name, arm.name) == owner.key and not arm.shadow:
            path = f"/responses/{response_id}{suffix}"
            return await arm.lookup(method, path, params, deployment.name)
    return None  # its arm is gone: the gateway's store may still hold it


async def _stored(state: GatewayState, principal: str, response_id: str) -> StoredResponse:
    entry = await state.response_store.get(response_id, principal)
    if entry is None:
        raise _not_found(response_id)
    return entry


@stored_responses.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response: the gateway's (a local arm answered it) or an upstream arm's."""
    state, principal = _state(request), request_principal(request).name
    reply = await _from_arms(state, principal, response_id, "GET")
    return reply if reply is not None else (await _stored(state, principal, response_id)).response


@stored_responses.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = DEFAULT_LIMIT,
    order: str = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
) -> dict[str, Any]:
    """A stored response's input items, as OpenAI's cursor list (response_input_items.py)."""
    if include:
        raise invalid("'include' is not supported for input items.", "include")
    state, principal = _state(request), request_principal(request).name
    params = {"limit": str(limit), "order": order} | ({"after": after} if after else {})
    reply = await _from_arms(state, principal, response_id, "GET", "/input_items", **params)
    if reply is not None:
        return reply
    page = input_items_page(await _stored(state, principal, response_id), limit, order, after)
    if isinstance(page, ParamProblem):
        raise problem_error(page)
    return page


@stored_responses.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response, in the gateway's store or on the upstream that holds it."""
    state, principal = _state(request), request_principal(request).name
    reply = await _from_arms(state, principal, response_id, "DELETE")
    if reply is None:
        if not await state.response_store.delete(response_id, principal):
            raise _not_found(response_id)
        reply = deleted_body(response_id)
    await state.response_store.forget_owner(response_id, principal)
    return reply
