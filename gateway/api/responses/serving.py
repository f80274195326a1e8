"""POST /v1/responses on a local engine: the Responses API over the chat pipeline.

    input items (+ the stored conversation of previous_response_id, + instructions)
    -> chat messages and tools (responses_convert.py) -> the chat template (tool prompt
    included) -> engine -> ToolCallStreamParser events -> ResponseBuilder
    -> a `response` object, or its typed stream events (`event:` lines, sequence_number)

With `store` (the default) the finished response and the conversation through it go into
the gateway's bounded `ResponseStore`, for `previous_response_id` and
`GET /v1/responses/{id}`. Everything the API has that Carousel does not serve (built-in
tools, reasoning, background, ...) is a 400 naming it (protocol_responses.unsupported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from gateway.api.errors import APIError
from gateway.api.local_request import LocalRequest
from gateway.api.outputs.plan import OutputPlan, off_loop, problem_error, tools_plan
from gateway.api.outputs.tool_parser import StreamEvent, ToolCallStreamParser
from gateway.api.pipeline import ChoiceResult, EngineRuntime, accept_output, encode
from gateway.api.problems import ParamProblem
from gateway.api.prompts import chat_prompt
from gateway.api.responses.convert import conversation_after, response_skeleton, to_chat
from gateway.api.responses.events import ResponseBuilder
from gateway.api.responses.protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    unsupported,
)
from gateway.api.responses.store import (
    MemoryResponseStore,
    ResponseStore,
    previous_conversation,
    remember_creator,
)
from gateway.api.sampling_defaults import sampling_fields
from gateway.api.serving import LocalEndpoint
from schedulers.client import RequestStream
from schedulers.sampling_params import SamplingParams

#: chat param spellings -> the Responses API's (its function tools are flat)
_RENAME = {"tool_choice.function.name": "tool_choice.name", ".function.": "."}
#: the store of a request that has none (a shadow copy): nothing is ever found in it
_NO_STORE = MemoryResponseStore(1)


class ResponsesEndpoint(LocalEndpoint[ResponsesRequest]):
    """POST /v1/responses on a local engine, keeping responses in `store` (None: none are
    kept and no `previous_response_id` is found, as for a shadow copy)."""

    prompt_param = "input"

    def __init__(self, runtime: EngineRuntime, store: ResponseStore | None = None) -> None:
        super().__init__(runtime)
        self.store = store

    def check(self, request: ResponsesRequest) -> None:
        problem = unsupported(request)
        if problem is not None:
            raise problem_error(problem)

    async def plan(self, req: LocalRequest[ResponsesRequest]) -> OutputPlan:
        request, store = req.request, self.store or _NO_STORE
        history = await previous_conversation(
            store, request.previous_response_id, req.ctx.principal
        )
        if isinstance(history, ParamProblem):
            raise problem_error(history)
        parts = to_chat(request, history)
        if isinstance(parts, ParamProblem):
            raise problem_error(parts)
        plan = await off_loop(
            tools_plan,
            parts.tools,
            parts.tool_choice,
            parts.parallel_tool_calls,
            parts.answer,
            _format_param(request.text),
            _RENAME,
        )
        extra = {"history": history, "input_items": parts.input_items}
        return dataclasses.replace(plan, messages=parts.messages, extra=extra)

    async def prompts(self, req: LocalRequest[ResponsesRequest]) -> list[list[int]]:
        assert req.plan.messages is not None
        prompt = chat_prompt(self.runtime, req.plan.messages, req.plan, "input")
        req.ctx.outcome.record_prompt(prompt)
        return [await encode(self.runtime.tokenizer, prompt)]

    def requested_max_tokens(self, request: ResponsesRequest) -> tuple[int | None, str]:
        return request.max_output_tokens, "max_output_tokens"

    def sampling_params(self, request: ResponsesRequest, max_tokens: int) -> SamplingParams:
        defaults = self.runtime.sampling_defaults
        return SamplingParams(max_tokens=max_tokens, **sampling_fields(request, defaults))

    def body(
        self, req: LocalRequest[ResponsesRequest], results: list[ChoiceResult]
    ) -> dict[str, Any]:
        builder = _builder(req)
        builder.start()
        parser = ToolCallStreamParser() if req.plan.parses_tools else None
        result = results[0]
        builder.feed(_events(parser, result.text, finished=True))
        builder.finish(_usage(req, result.num_output_tokens), result.finish_reason)
        req.plan.extra["response"] = builder.response
        return builder.response.model_dump(mode="json")

    async def keep(self, req: LocalRequest[ResponsesRequest]) -> None:
        """Store the finished response (`store`), once its body is built."""
        await _store(self.store, req, req.plan.extra["response"])

    def chunks(
        self, req: LocalRequest[ResponsesRequest], stream: RequestStream
    ) -> AsyncGenerator[str, None]:
        return _chunks(self.runtime, self.store, req, stream)


async def _chunks(
    runtime: EngineRuntime,
    store: ResponseStore | None,
    req: LocalRequest[ResponsesRequest],
    stream: RequestStream,
) -> AsyncGenerator[str, None]:
    """The typed events, in OpenAI's order (responses_stream.py); an engine error after the
    200 ends the stream with `response.failed`, then the in-band error."""
    builder = _builder(req)
    parser = ToolCallStreamParser() if req.plan.parses_tools else None
    try:
        for event in builder.start():
            yield event.model_dump_json()
        try:
            async for _, output in stream:
                accept_output(runtime, req.ctx, output)
                events = _events(parser, output.text, output.finished)
                for event in builder.feed(events):
                    yield event.model_dump_json()
                if output.finished:
                    usage = _usage(req, output.num_output_tokens)
                    for event in builder.finish(usage, output.finish_reason):
                        yield event.model_dump_json()
        except APIError as exc:
            for event in builder.fail(exc.message):
                yield event.model_dump_json()
            raise
        await _store(store, req, builder.response)
    finally:
        stream.close()


def _builder(req: LocalRequest[ResponsesRequest]) -> ResponseBuilder:
    return ResponseBuilder(response_skeleton(req.request, req.ctx.model))


def _events(parser: ToolCallStreamParser | None, text: str, finished: bool) -> list[StreamEvent]:
    """Content and call events of newly generated `text` (plain text without tools)."""
    if parser is None:
        return [text] if text else []
    events = parser.feed(text) if text else []
    return events + parser.finish() if finished else events


def _usage(req: LocalRequest[ResponsesRequest], num_output_tokens: int) -> ResponseUsage:
    ctx = req.ctx
    return ResponseUsage.of(ctx.prompt_tokens, num_output_tokens, ctx.cached_tokens)


async def _store(
    store: ResponseStore | None, req: LocalRequest[ResponsesRequest], response: ResponseObject
) -> None:
    """Keep a finished response for `previous_response_id` and GET (when `store`), as its
    principal's, and which arm created it."""
    if req.request.store is False or store is None:
        return
    plan, ctx = req.plan, req.ctx
    conversation = conversation_after(plan.extra["history"], plan.extra["input_items"], response)
    body = response.model_dump(mode="json")
    await store.put(response.id, body, conversation, principal=ctx.principal)
    await remember_creator(store, ctx, response.id)


def _format_param(text: dict[str, Any] | None) -> str | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    return "text.format.schema" if fmt.get("type") == "json_schema" else "text.format"
