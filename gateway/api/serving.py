"""The one local pipeline every endpoint shares: preprocess -> generate -> build.

    check fields -> output plan (tools, grammar; its compile starts) -> prompts (token ids)
    -> context budget -> SamplingParams (+ the compiled grammar, awaited; whom it is served
    for, its deadline: gateway/api/scheduling.py) -> engine stream (at its priority)
    -> (stream) chunk payloads | (non-stream) collect -> response body

An endpoint supplies only what differs: how its request becomes a plan, prompts and
parameters (`plan`, `prompts`, `requested_max_tokens`, `logprobs`) and how outputs become
its wire shapes (`body`, `chunks`). Chat, completions and responses are subclasses of
`LocalEndpoint`, each built over one arm's engine (`runtime`); every hook is handed the one
per-request object, `LocalRequest`. A grammar that cannot be served is a 400 (503 when the
compiler is busy) before anything is queued (gateway/api/outputs/plan.py).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any, Generic, TypeVar

from gateway.api.endpoint import Reply
from gateway.api.local_request import LocalRequest
from gateway.api.outputs.plan import OutputPlan, finish_compile, start_compile
from gateway.api.payload_stream import PayloadStream
from gateway.api.pipeline import (
    ChoiceResult,
    EngineRuntime,
    check_stream_options,
    collect,
    context_budget,
    log_ignored_fields,
    open_stream,
    sampling_params,
)
from gateway.api.scheduling import scheduled_priority, served_for
from gateway.context import RequestContext
from schedulers.client import RequestStream
from schedulers.sampling_params import SamplingParams

RequestT = TypeVar("RequestT")


class LocalEndpoint(abc.ABC, Generic[RequestT]):
    """How one arm's engine serves one endpoint: `await ChatEndpoint(runtime)(request, ctx)`.

    The endpoint table (gateway/api/table.py) names the class; a local arm builds it once
    over its `EngineRuntime` (gateway/arms/local.py).
    """

    #: the request field that holds the prompt (named by context-length errors)
    prompt_param: str = "prompt"

    def __init__(self, runtime: EngineRuntime) -> None:
        self.runtime = runtime

    async def __call__(self, request: Any, ctx: RequestContext) -> Reply:
        runtime = self.runtime
        log_ignored_fields(request, ctx)
        self.check(request)
        check_stream_options(request)
        ctx.outcome.assign_scheduler(runtime.scheduler)
        req: LocalRequest[RequestT] = LocalRequest(request, ctx)
        req.plan = await self.plan(req)
        pending = start_compile(runtime.grammar_compiler, req.plan, ctx.principal)
        req.prompts = prompts = await self.prompts(req)
        ctx.outcome.record_prompt_tokens(sum(len(p) for p in prompts))
        requested, requested_param = self.requested_max_tokens(request)
        longest = max(len(p) for p in prompts)
        max_tokens = context_budget(requested, requested_param, longest, runtime, self.prompt_param)
        params = self.sampling_params(request, max_tokens)
        grammar = await finish_compile(pending, req.plan, runtime.options.retry_after_s)
        if grammar is not None:
            params = dataclasses.replace(params, grammar=grammar)
        params = dataclasses.replace(
            params,
            principal=served_for(ctx.principal, getattr(request, "user", None)),
            deadline_ms=ctx.deadline_ms,
            min_deadline_ms=ctx.min_deadline_ms,
        )
        priority = scheduled_priority(ctx, request)
        stream = open_stream(runtime, ctx, prompts, params, self.prompt_param, priority)
        ctx.outcome.accept()
        if request.stream:
            return PayloadStream(self.chunks(req, stream), stream.close)
        results = await collect(runtime, stream, ctx, len(prompts) * params.n)
        body = self.body(req, results)
        await self.keep(req)
        return body

    def check(self, request: RequestT) -> None:  # noqa: B027 - optional hook
        """Refuse, by name, fields this endpoint does not implement."""

    async def plan(self, req: LocalRequest[RequestT]) -> OutputPlan:
        """The request's tools and output constraint (default: none); raise a 400 (404)
        naming the param of what cannot be served."""
        return OutputPlan()

    @abc.abstractmethod
    async def prompts(self, req: LocalRequest[RequestT]) -> list[list[int]]:
        """The prompts as token ids (also recording the rendered prompt in
        `req.ctx.outcome` for the log)."""

    @abc.abstractmethod
    def requested_max_tokens(self, request: RequestT) -> tuple[int | None, str]:
        """(the completion budget asked for, None if absent; the field that asked it)."""

    def logprobs(self, request: RequestT) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        return None

    def sampling_params(self, request: RequestT, max_tokens: int) -> SamplingParams:
        """The engine's parameters for `request` under the budget `max_tokens`."""
        return sampling_params(request, self.runtime, max_tokens, self.logprobs(request))  # type: ignore[arg-type]

    @abc.abstractmethod
    def body(self, req: LocalRequest[RequestT], results: list[ChoiceResult]) -> dict[str, Any]:
        """The non-streaming response body."""

    async def keep(self, req: LocalRequest[RequestT]) -> None:  # noqa: B027
        """After `body`: keep what the endpoint stores (the Responses API's `store`)."""

    @abc.abstractmethod
    def chunks(
        self, req: LocalRequest[RequestT], stream: RequestStream
    ) -> AsyncGenerator[str, None]:
        """The stream's payloads (JSON strings), closing `stream` when done."""
