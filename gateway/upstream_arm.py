"""An arm answered by an upstream OpenAI-compatible server (vLLM, the OpenAI API, a Carousel).

The client's JSON body is forwarded as sent (with `model` rewritten to the upstream's name
by the client); replies come back with `model` set to the served name. Streams are passed
through chunk by chunk, never buffered; usage is always asked of the upstream so the
gateway can count tokens, and is stripped again when the client did not ask for it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from backends.upstream import UpstreamClient, UpstreamConfig, UpstreamError
from gateway.context import RequestContext
from gateway.deployment import Arm, Reply
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.streaming import PayloadStream


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

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply:
        return await self._forward("/chat/completions", ctx)

    async def completion(self, request: CompletionRequest, ctx: RequestContext) -> Reply:
        return await self._forward("/completions", ctx)

    async def _forward(self, path: str, ctx: RequestContext) -> Reply:
        ctx.scheduler = f"upstream:{self.config.model}"
        headers = {"X-Request-Id": ctx.request_id}
        body = dict(ctx.raw_body)
        if not ctx.stream:
            try:
                _, reply = await self.client.complete(path, body, headers)
            except UpstreamError as exc:
                raise api_error(exc) from None
            _account(ctx, reply)
            reply["model"] = ctx.model
            return reply
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
        payloads = _payloads(first, frames, ctx, wants_usage)
        return PayloadStream(payloads, on_close=lambda: None)


async def _payloads(
    first: bytes, frames: AsyncIterator[bytes], ctx: RequestContext, wants_usage: bool
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
            if not wants_usage:
                chunk.pop("usage", None)
                if not chunk.get("choices"):
                    continue  # the usage-only chunk the client did not ask for
            chunk["model"] = ctx.model
            yield json.dumps(chunk, ensure_ascii=False)
    finally:
        await _aclose(frames)


async def _aclose(frames: AsyncIterator[bytes]) -> None:
    """Close the upstream stream (and so its HTTP response) now."""
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()


def _account(ctx: RequestContext, reply: dict[str, Any]) -> None:
    usage = reply.get("usage") or {}
    ctx.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
    for choice in reply.get("choices") or []:
        if choice.get("finish_reason"):
            ctx.finish_reasons.append(str(choice["finish_reason"]))


def _account_chunk(ctx: RequestContext, chunk: dict[str, Any]) -> None:
    usage = chunk.get("usage")
    if usage:
        ctx.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            ctx.mark_token()
        if choice.get("finish_reason"):
            ctx.finish_reasons.append(str(choice["finish_reason"]))
