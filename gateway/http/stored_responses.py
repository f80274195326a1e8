"""Stored Responses API responses by id: `GET` and `DELETE /v1/responses/{id}`, and
`GET /v1/responses/{id}/input_items`.

A response a local arm served is in the gateway's `ResponseStore`; one an upstream arm
forwarded lives on its upstream (under the upstream's id), so these are sent to the arm the
store noted as its creator, and an id nobody noted is looked for on every upstream arm.
(`previous_response_id` is routed the same way, in routes.py.)
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
from gateway.state import GatewayState

stored_responses = APIRouter(prefix="/v1")
#: what a response id may be made of before it is put into an upstream's URL
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def _not_found(response_id: str) -> APIError:
    return not_found(f"Response with id '{response_id}' not found.", "response_id")


async def _from_arms(
    state: GatewayState, response_id: str, method: str, suffix: str = "", **params: str
) -> dict[str, Any] | None:
    """The answer of the arm whose own server holds `response_id` (an upstream arm's
    response, found by the arm noted when it was created, else by asking each upstream arm);
    None when the gateway's store holds it. A 404 names `response_id` when nothing has it."""
    if not _RESPONSE_ID.fullmatch(response_id):
        raise _not_found(response_id)
    path = f"/responses/{response_id}{suffix}"
    store = state.response_store
    owner = store.owner(response_id)
    if owner is None and store.get(response_id) is not None:
        return None
    for deployment, arm in state.deployments.arms():
        if arm.shadow or (owner is not None and (deployment.name, arm.name) != owner.key):
            continue
        try:
            reply = await arm.lookup(method, path, params, deployment.name)
        except APIError as exc:
            # NOTE: an id nobody noted is looked for on every arm: one's failure is no answer
            if owner is None or exc.status_code == 404:
                continue
            raise
        if reply is None and owner is not None:
            return None  # a local arm's: the gateway's store has it (or had it)
        if reply is not None:
            store.remember_owner(response_id, deployment.name, arm.name)
            return reply
    if store.get(response_id) is None:
        raise _not_found(response_id)
    return None


def _stored(state: GatewayState, response_id: str) -> StoredResponse:
    entry = state.response_store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


@stored_responses.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response: the gateway's (a local arm answered it) or an upstream arm's."""
    state = _state(request)
    reply = await _from_arms(state, response_id, "GET")
    return reply if reply is not None else _stored(state, response_id).response


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
    state = _state(request)
    params = {"limit": str(limit), "order": order} | ({"after": after} if after else {})
    reply = await _from_arms(state, response_id, "GET", "/input_items", **params)
    if reply is not None:
        return reply
    page = input_items_page(_stored(state, response_id), limit, order, after)
    if isinstance(page, ParamProblem):
        raise problem_error(page)
    return page


@stored_responses.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response, in the gateway's store or on the upstream that holds it."""
    state = _state(request)
    reply = await _from_arms(state, response_id, "DELETE")
    if reply is None:
        _stored(state, response_id)
        state.response_store.delete(response_id)
        reply = deleted_body(response_id)
    state.response_store.forget_owner(response_id)
    return reply
