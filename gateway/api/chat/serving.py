"""POST /v1/chat/completions on a local engine: messages (+ tools, rendered by
gateway/api/outputs/tools.py) -> chat template -> tokens -> engine -> a `chat.completion` body or
`chat.completion.chunk` payloads. With tools, calls are parsed out of the text
(`message.tool_calls`, streamed as `delta.tool_calls`); the output constraint is the plan's
(gateway/api/outputs/plan.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from gateway.api.chunk_template import TextChunks
from gateway.api.errors import invalid, unsupported
from gateway.api.local_request import LocalRequest
from gateway.api.logprobs import chat_logprobs
from gateway.api.outputs.plan import OutputPlan, chat_plan, has_schemas, off_loop
from gateway.api.outputs.tool_parser import (
    StreamEvent,
    ToolCallStreamParser,
    chat_finish_reason,
    parse_tool_calls,
)
from gateway.api.pipeline import ChoiceResult, EngineRuntime, accept_output, encode
from gateway.api.prompts import chat_prompt
from gateway.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from gateway.api.serving import LocalEndpoint
from schedulers.client import RequestStream

# NOTE: `developer` is OpenAI's newer name for `system`; templates only know the latter.
_TEMPLATE_ROLE = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def check_unsupported(request: ChatCompletionRequest) -> None:
    """Refuse, by name, the fields whose meaning Carousel does not implement."""
    if request.functions:
        raise unsupported("functions", " (the deprecated function calling; use tools)")
    if request.function_call not in (None, "none"):
        raise unsupported("function_call", " (the deprecated function calling; use tool_choice)")
    if request.modalities not in (None, ["text"]):
        raise unsupported("modalities", ': only ["text"] is served')
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(request, name) is not None:
            raise unsupported(name)
    if request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs requires logprobs to be true.", "top_logprobs")


def message_text(message: ChatMessage, param: str) -> str:
    """The message's content as one string (text parts joined by newlines)."""
    content = message.content
    if content is None:
        if message.role in ("assistant", "tool"):
            return ""
        raise invalid(f"Missing required parameter: '{param}.content'.", f"{param}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        if part.type != "text":
            raise invalid(
                f"Content parts of type {part.type!r} are not supported; only 'text' is.",
                f"{where}.type",
            )
        if part.text is None:
            raise invalid(f"Missing required parameter: '{where}.text'.", f"{where}.text")
        texts.append(part.text)
    return "\n".join(texts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """`messages` as plain dicts for `render_conversation`, checking roles and content."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = _TEMPLATE_ROLE.get(message.role)
        if role is None:
            raise invalid(
                f"Invalid value for '{param}.role': {message.role!r}; expected one of "
                "'system', 'developer', 'user', 'assistant', 'tool'.",
                f"{param}.role",
            )
        if message.function_call is not None:
            raise unsupported(f"{param}.function_call", " (the deprecated function calling)")
        turn: dict[str, Any] = {"role": role, "content": message_text(message, param)}
        if message.tool_calls:
            if role != "assistant":
                raise invalid(
                    "Only assistant messages may carry tool_calls.", f"{param}.tool_calls"
                )
            turn["tool_calls"] = message.tool_calls
        if role == "tool":
            turn["tool_call_id"] = message.tool_call_id
            if message.name:
                turn["name"] = message.name
        out.append(turn)
    return out


class ChatEndpoint(LocalEndpoint[ChatCompletionRequest]):
    """POST /v1/chat/completions on a local engine."""

    prompt_param = "messages"

    def check(self, request: ChatCompletionRequest) -> None:
        check_unsupported(request)

    async def plan(self, req: LocalRequest[ChatCompletionRequest]) -> OutputPlan:
        request = req.request
        return await off_loop(chat_plan, request) if has_schemas(request) else chat_plan(request)

    async def prompts(self, req: LocalRequest[ChatCompletionRequest]) -> list[list[int]]:
        messages = conversation(req.request.messages)
        prompt = chat_prompt(self.runtime, messages, req.plan, "messages")
        req.ctx.outcome.record_prompt(prompt)
        return [await encode(self.runtime.tokenizer, prompt)]

    def requested_max_tokens(self, request: ChatCompletionRequest) -> tuple[int | None, str]:
        if request.max_completion_tokens is not None:
            return request.max_completion_tokens, "max_completion_tokens"
        return request.max_tokens, "max_tokens"

    def logprobs(self, request: ChatCompletionRequest) -> int | None:
        return (request.top_logprobs or 0) if request.logprobs else None

    def body(
        self, req: LocalRequest[ChatCompletionRequest], results: list[ChoiceResult]
    ) -> dict[str, Any]:
        return _body(self.runtime, req, results).model_dump(mode="json")

    def chunks(
        self, req: LocalRequest[ChatCompletionRequest], stream: RequestStream
    ) -> AsyncGenerator[str, None]:
        return _chunks(self.runtime, req, stream)


def _message(plan: OutputPlan, result: ChoiceResult) -> tuple[AssistantMessage, str | None]:
    """The assistant message of one choice, and its finish reason (`tool_calls` when the
    model stopped after calling tools, `stop` after the call a named `tool_choice` forced)."""
    if not plan.parses_tools:
        return AssistantMessage(content=result.text), result.finish_reason
    parsed = parse_tool_calls(result.text)
    calls = [call.as_openai() for call in parsed.tool_calls] or None
    message = AssistantMessage(content=parsed.content, tool_calls=calls)
    forced = plan.tool_choice.forced
    return message, chat_finish_reason(bool(calls), result.finish_reason, forced)


def _body(
    runtime: EngineRuntime, req: LocalRequest[ChatCompletionRequest], results: list[ChoiceResult]
) -> ChatCompletionResponse:
    request, ctx, plan = req.request, req.ctx, req.plan
    num_top = request.top_logprobs or 0
    choices = []
    for i, r in enumerate(results):
        message, finish_reason = _message(plan, r)
        logprobs = (
            chat_logprobs(r.logprobs, runtime.token_text, num_top) if request.logprobs else None
        )
        choices.append(
            ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish_reason)
        )
    completion_tokens = sum(r.num_output_tokens for r in results)
    return ChatCompletionResponse(
        id=f"chatcmpl-{ctx.request_id}",
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=UsageInfo.of(ctx.prompt_tokens, completion_tokens, ctx.cached_tokens),
    )


def _deltas(events: list[StreamEvent]) -> list[DeltaMessage]:
    """Parser events as chat deltas: content text, or one tool call piece each."""
    return [
        DeltaMessage(content=e) if isinstance(e, str) else DeltaMessage(tool_calls=[e.as_openai()])
        for e in events
    ]


async def _chunks(
    runtime: EngineRuntime, req: LocalRequest[ChatCompletionRequest], stream: RequestStream
) -> AsyncGenerator[str, None]:
    """Role chunk per choice, content (or tool call) deltas, a finish chunk per choice,
    [usage]. With tools, each choice's text goes through its own `ToolCallStreamParser`."""
    request, ctx, plan = req.request, req.ctx, req.plan
    include_usage = request.include_usage
    num_top = request.top_logprobs or 0
    parsers = [ToolCallStreamParser() for _ in range(request.n)] if plan.parses_tools else None

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(
            id=f"chatcmpl-{ctx.request_id}",
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
        )
        return body.model_dump_json(exclude=None if include_usage else {"usage"})

    contents = TextChunks(
        lambda index, text: chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text))])
    )
    try:
        for i in range(request.n):
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
        async for index, output in stream:
            accept_output(runtime, ctx, output)
            logprobs = None
            if request.logprobs and output.logprobs:
                logprobs = chat_logprobs(output.logprobs, runtime.token_text, num_top)
            finish_reason = output.finish_reason
            if parsers is None and logprobs is None:
                if output.text:
                    yield contents(index, output.text)
                deltas = []
            elif parsers is None:
                deltas = [DeltaMessage(content=output.text)] if output.text else []
            else:
                parser = parsers[index]
                events = parser.feed(output.text) if output.text else []
                if output.finished:
                    events += parser.finish()
                    called = bool(parser.tool_calls)
                    forced = plan.tool_choice.forced
                    finish_reason = chat_finish_reason(called, finish_reason, forced)
                deltas = _deltas(events)
            if logprobs is not None and not deltas:
                deltas = [DeltaMessage()]
            for j, delta in enumerate(deltas):
                piece = ChatChunkChoice(
                    index=index, delta=delta, logprobs=logprobs if j == 0 else None
                )
                yield chunk([piece])
            if output.finished:
                final = ChatChunkChoice(
                    index=index, delta=DeltaMessage(), finish_reason=finish_reason
                )
                yield chunk([final])
        if include_usage:
            yield chunk(
                [], UsageInfo.of(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)
            )
    finally:
        stream.close()
