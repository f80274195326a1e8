"""HTTP routes: parse and authenticate, pick the deployment's arm, shape its reply.

One route per endpoint of the table (gateway/api/table.py), all served by `_serve`: it
turns the body into the endpoint's request model, asks the arm, and frames the answer as
JSON or SSE in the endpoint's stream format. Every request ends in exactly one access log
line (`RequestServices.finish`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from gateway import carousel_version
from gateway.api.endpoint import Endpoint
from gateway.api.errors import APIError, error_body, from_validation_error, invalid, shown
from gateway.api.outputs.plan import problem_error
from gateway.api.protocol import ModelCard, ModelList
from gateway.api.responses.store import previous_not_found
from gateway.api.scheduling import DEADLINE_HEADER, bound_request
from gateway.api.table import ENDPOINTS
from gateway.arms.choice import ARM_HEADER
from gateway.arms.deployment import Deployment
from gateway.context import CLIENT_CLOSED, ClientDisconnected, RequestContext
from gateway.http.auth import request_principal
from gateway.http.rollout_admin import rollout_admin
from gateway.http.sse import SSEResponse
from gateway.http.stored_responses import stored_responses
from gateway.obs.metrics import CONTENT_TYPE
from gateway.state import GatewayState
from schedulers.load_phase import (
    BUILDING_KERNELS_IN_BACKGROUND,
    KERNELS_BUILDING,
    current_load_phase,
)

router = APIRouter()
v1 = APIRouter(prefix="/v1")


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
        # NOTE: JSON may escape lone surrogates (\ud800) that no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeError included
        raise invalid(
            f"We could not parse the JSON body of your request ({exc}). The API expects a "
            "JSON object of valid UTF-8 text in the request body.",
        ) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc.errors()) from None


async def _serve(request: Request, path: str) -> Response:
    state = _state(request)
    endpoint = state.endpoints[path]
    services = state.services
    principal = request_principal(request)
    ctx = RequestContext(
        request_id=request.state.request_id,
        engine_request_id=request.state.engine_request_id,
        endpoint=endpoint.name,
        model="",
        is_disconnected=request.is_disconnected,
        log_prompts=state.settings.log_prompts,
        path=endpoint.path,
        principal=principal.name,
    )
    try:
        body = await read_json(request)
        parsed = parse(endpoint.request_model, body)
        # NOTE: cut: the access log line, metrics and errors show it (a 1 MB model, logged)
        model, stream = shown(parsed.model), bool(parsed.stream)
        ctx = replace(ctx, model=model, stream=stream, raw_body=body, user=parsed.user)
        ctx = bound_request(ctx, parsed, principal, request.headers.get(DEADLINE_HEADER))
        deployment = state.deployments.get(parsed.model)
        continued = await _owner_arm(state, deployment, parsed, principal.name)
        pinned = request.headers.get(ARM_HEADER)
        arm = deployment.pick(
            ctx, state.settings.retry_after_s, pinned or continued, parsed.user, principal, pinned
        )
        if deployment.mirrors and not arm.shadow:
            ctx.outcome.call_when_accepted(lambda: deployment.mirror(endpoint, body, ctx))
        reply = await arm.serve(endpoint, parsed, ctx, services)
        ctx.outcome.accept()
    except APIError as exc:
        services.finish(ctx, exc.status_code, exc.message)
        if ctx.arm is not None:
            exc.headers[ARM_HEADER] = ctx.arm
        raise
    except ClientDisconnected:
        services.finish(ctx, CLIENT_CLOSED, "client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        services.finish(ctx, 500, repr(exc))
        raise
    headers = {ARM_HEADER: arm.name}
    if isinstance(reply, dict):
        services.finish(ctx, 200)
        return JSONResponse(reply, headers=headers)
    ping_s = state.settings.sse_ping_s
    response = SSEResponse(
        reply, partial(services.finish, ctx), ping_s=ping_s, stream_format=endpoint.stream_format
    )
    response.headers.update(headers)
    return response


async def _owner_arm(
    state: GatewayState, deployment: Deployment, request: BaseModel, principal: str
) -> str | None:
    """The arm that created the response a request continues (`previous_response_id`), when
    it serves this deployment: the conversation is there (an upstream's own store) and stays
    on one arm of an A/B split. A 404 when `principal` has no such response: no arm, local or
    upstream, is asked to continue another principal's conversation."""
    previous = getattr(request, "previous_response_id", None)
    if not isinstance(previous, str):
        return None
    store = state.response_store
    owner = await store.owner(previous, principal)
    if owner is None and await store.get(previous, principal) is None:
        raise problem_error(previous_not_found(previous))
    if owner is None or owner.model != deployment.name:
        return None
    return owner.arm if any(arm.name == owner.arm for arm in deployment.arms) else None


def _route(endpoint: Endpoint) -> Any:
    async def route(request: Request) -> Response:
        return await _serve(request, endpoint.path)

    route.__name__ = endpoint.name
    return route


for _endpoint in ENDPOINTS:
    router.add_api_route(_endpoint.path, _route(_endpoint), methods=["POST"], name=_endpoint.name)


def _card(state: GatewayState, name: str) -> ModelCard:
    deployment = state.deployments.get(name)
    return ModelCard(
        id=deployment.name,
        created=deployment.created,
        root=state.settings.model if deployment.name == state.settings.model_name else None,
        max_model_len=deployment.max_model_len,
    )


@v1.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return ModelList(data=[_card(state, d.name) for d in state.deployments]).model_dump()


@v1.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    return _card(_state(request), model_id).model_dump()


#: the load phase of a loading server's `/health` 503 (schedulers/load_phase.py's names); on a
#: ready server's 200, `building_kernels_in_background` while an arm's CPU kernels build
LOAD_PHASE_HEADER = "X-Carousel-Load-Phase"


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    problem = state.deployments.unavailable_reason()
    if problem is None:
        return _ready(state.deployments.serving_kernels())
    reason, loading = problem
    body = error_body(
        f"Not ready: {reason}", "server_error", None, "model_loading" if loading else "engine_dead"
    )
    headers = {"Retry-After": str(state.settings.retry_after_s)}
    phase = current_load_phase() if loading else None
    if phase is not None:  # NOTE: the message says it in words; the body stays OpenAI's shape
        headers[LOAD_PHASE_HEADER] = phase.name
    return JSONResponse(body, status_code=503, headers=headers)


def _ready(kernels: dict[str, str]) -> Response:
    """A ready server's `/health`: which ops serve each local arm's CPU forward (`kernels`,
    by `model/arm`: `torch`, `building`, `carousel`), and the header while any still builds."""
    if not kernels:
        return JSONResponse({"status": "ok"})
    building = KERNELS_BUILDING in kernels.values()
    headers = {LOAD_PHASE_HEADER: BUILDING_KERNELS_IN_BACKGROUND} if building else None
    return JSONResponse({"status": "ok", "kernels": kernels}, headers=headers)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


debug = APIRouter(prefix="/debug")  # NOTE: behind the key, like /v1 (APIKeyMiddleware)


@debug.get("/trace")
async def iteration_trace(
    request: Request, arm: str | None = None, since: float | None = None, limit: int = 0
) -> dict[str, Any]:
    """Each local arm's recent iterations (start, duration, sequences, prefill/decode tokens).

    `arm` keeps one arm, `since` (unix seconds) keeps iterations that started after it, and
    `limit` > 0 keeps the last `limit` of them.
    """
    state = _state(request)
    arms: dict[str, Any] = {}
    for _, candidate in state.deployments.arms():
        if arm is not None and candidate.name != arm:
            continue
        trace = candidate.trace()
        if trace is None:
            continue
        iterations = trace["iterations"]
        if since is not None:
            iterations = [it for it in iterations if it["start"] >= since]
        if limit > 0:
            iterations = iterations[-limit:]
        arms[candidate.name] = {**trace, "iterations": iterations}
    if arm is not None and arm not in arms:
        raise invalid(f"No local arm named `{arm}` has a trace.", param="arm")
    return {"arms": arms}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": carousel_version()}


router.include_router(v1)
router.include_router(stored_responses)
router.include_router(debug)
router.include_router(rollout_admin)
