"""An arm answered by an upstream OpenAI-compatible server (vLLM, the OpenAI API, a Carousel).

Any endpoint of the table is forwarded the same way, with no per-endpoint code: the
client's JSON body goes to the endpoint's path under the upstream's base URL as sent (with
`model` rewritten to the upstream's name by the client); replies come back with `model`
set to the served name. Streams are passed through chunk by chunk, never buffered. Where
an endpoint reports usage only on request (`stream_options.include_usage`), usage is
always asked of the upstream so the gateway can count tokens, and stripped again when the
client did not ask for it. Usage is read in either naming (prompt/completion tokens or
input/output tokens, at the top level or in a streamed `response` object).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pydantic import BaseModel

from backends.upstream import UpstreamClient, UpstreamConfig, UpstreamError
from backends.upstream.config import display_url
from gateway.api.endpoint import Endpoint, Reply
from gateway.api.errors import APIError
from gateway.api.payload_stream import PayloadStream
from gateway.arms.arm import Arm
from gateway.context import RequestContext
from gateway.obs.metrics import ArmInfo, upstream_device_group
from gateway.services import RequestServices


def api_error(exc: UpstreamError) -> APIError:
    return APIError(exc.status, exc.message, exc.type, exc.param, exc.code)


class UpstreamArm(Arm):
    """Proxies an arm's requests to one upstream (one or more replicas) over httpx."""

    kind = "upstream"

    def __init__(self, name: str, config: UpstreamConfig, weight: float = 1.0) -> None:
        self.name = name
        self.weight = weight
        self.config = config
        self._client: UpstreamClient | None = None

    async def start(self) -> None:
        client = UpstreamClient(self.config)
        await client.start()
        self._client = client

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()

    def info(self, model: str) -> ArmInfo:
        # NOTE: display URLs: a label must not show userinfo or an `api-key` query
        urls = ",".join(sorted(display_url(url).rstrip("/") for url in self.config.base_urls))
        return ArmInfo(model, self.name, self.kind, upstream_device_group(urls))

    @property
    def unavailable_reason(self) -> str | None:
        return "the upstream client is starting" if self._client is None else None

    @property
    def is_loading(self) -> bool:
        return self._client is None

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            raise RuntimeError(f"arm {self.name!r} has not started")
        return self._client

    async def serve(
        self, endpoint: Endpoint, request: BaseModel, ctx: RequestContext, services: RequestServices
    ) -> Reply:
        ctx.outcome.assign_scheduler(f"upstream:{self.config.model}")
        path = endpoint.upstream_path
        headers = {"X-Request-Id": ctx.request_id}
        body = dict(ctx.raw_body)
        if not ctx.stream:
            try:
                _, reply = await self.client.complete(path, body, headers)
            except UpstreamError as exc:
                raise api_error(exc) from None
            ctx.outcome.accept()
            _account(ctx, reply)
            await _remember(ctx, services, body, reply)
            _relabel(reply, ctx.model)
            return reply
        wants_usage = True
        if endpoint.usage_via_stream_options:
            options = body.get("stream_options")
            wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            body["stream_options"] = {"include_usage": True}
        frames = self.client.stream(path, body, headers)
        try:  # NOTE: failures before the first byte become a plain HTTP error, not a stream
            first = await frames.__anext__()
        except UpstreamError as exc:
            await _aclose(frames)
            raise api_error(exc) from None
        except StopAsyncIteration:
            first = b"data: [DONE]\n\n"
        ctx.outcome.accept()
        payloads = _payloads(first, frames, ctx, services, wants_usage)
        return PayloadStream(payloads, on_close=lambda: None)

    async def lookup(
        self, method: str, path: str, params: dict[str, str], model: str
    ) -> dict[str, Any] | None:
        try:
            reply = await self.client.lookup(method, path, params)
        except UpstreamError as exc:
            raise api_error(exc) from None
        _relabel(reply, model)
        return reply


async def _payloads(
    first: bytes,
    frames: AsyncIterator[bytes],
    ctx: RequestContext,
    services: RequestServices,
    wants_usage: bool,
) -> AsyncGenerator[str, None]:
    """Chunk payloads of the upstream stream, re-labelled with the served model name."""

    async def all_frames() -> AsyncIterator[bytes]:
        yield first
        async for frame in frames:
            yield frame

    try:
        async for frame in all_frames():
            text = frame.decode("utf-8").strip()
            if not text.startswith("data:"):
                continue
            data = text[len("data:") :].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                raise APIError(
                    502,
                    str(error.get("message", "the upstream failed mid-stream")),
                    str(error.get("type", "server_error")),
                    error.get("param"),
                    error.get("code"),
                )
            _account_chunk(ctx, chunk)
            if chunk.get("type") == "response.created":
                await _remember(ctx, services, ctx.raw_body, chunk.get("response"))
            if not wants_usage:
                chunk.pop("usage", None)
                if not chunk.get("choices"):
                    continue  # the usage-only chunk the client did not ask for
            _relabel(chunk, ctx.model)
            yield json.dumps(chunk, ensure_ascii=False)
    finally:
        await _aclose(frames)


async def _aclose(frames: AsyncIterator[bytes]) -> None:
    """Close the upstream stream (and so its HTTP response) now."""
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()


def _relabel(body: dict[str, Any], model: str) -> None:
    """Name the served model where the upstream named its own (a streamed `response` too)."""
    if "model" in body:
        body["model"] = model
    response = body.get("response")
    if isinstance(response, dict) and "model" in response:
        response["model"] = model


async def _remember(
    ctx: RequestContext, services: RequestServices, body: dict[str, Any], reply: Any
) -> None:
    """Note the id of a stored Responses API response this arm created (its upstream keeps
    it): GET, DELETE and `previous_response_id` of that id are routed back here."""
    if not isinstance(reply, dict) or reply.get("object") != "response":
        return
    if body.get("store") is not False and isinstance(reply.get("id"), str):
        await services.remember_response(ctx, reply["id"])


def _read_usage(ctx: RequestContext, body: dict[str, Any]) -> None:
    """Token counts from `usage`, in chat/completions' or the Responses API's naming."""
    usage = body.get("usage")
    response = body.get("response")
    if not usage and isinstance(response, dict):
        usage = response.get("usage")
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    ctx.outcome.record_usage(int(prompt or 0), int(completion or 0))


def _account(ctx: RequestContext, reply: dict[str, Any]) -> None:
    _read_usage(ctx, reply)
    for choice in reply.get("choices") or []:
        if choice.get("finish_reason"):
            ctx.outcome.record_finish(str(choice["finish_reason"]))
    if reply.get("object") == "response" and reply.get("status"):
        ctx.outcome.record_finish(str(reply["status"]))


def _account_chunk(ctx: RequestContext, chunk: dict[str, Any]) -> None:
    _read_usage(ctx, chunk)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
            ctx.outcome.record_token(ctx.start)
        if choice.get("finish_reason"):
            ctx.outcome.record_finish(str(choice["finish_reason"]))
    kind = chunk.get("type")
    if isinstance(kind, str) and kind.endswith(".delta") and chunk.get("delta"):
        ctx.outcome.record_token(ctx.start)  # a Responses API text or arguments delta
    if kind == "response.completed" and isinstance(chunk.get("response"), dict):
        ctx.outcome.record_finish(str(chunk["response"].get("status", "completed")))
