"""POST /v1/chat/completions on a local engine: messages -> chat template -> tokens ->
engine -> a `chat.completion` body or `chat.completion.chunk` payloads."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from gateway.context import RequestContext
from gateway.errors import invalid, unsupported
from gateway.logprobs import chat_logprobs
from gateway.protocol import (
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
from gateway.serving import LocalEndpoint
from gateway.serving_common import ChoiceResult, EngineRuntime, accept_output, encode
from schedulers.client import RequestStream

# NOTE: `developer` is OpenAI's newer name for `system`; templates only know the latter.
_TEMPLATE_ROLE = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def check_unsupported(request: ChatCompletionRequest) -> None:
    """Refuse, by name, the fields whose meaning Carousel does not implement."""
    if request.tools:
        raise unsupported("tools", " (no tool calling)")
    if request.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", " (no tool calling)")
    if request.functions:
        raise unsupported("functions", " (no function calling)")
    if request.function_call not in (None, "none"):
        raise unsupported("function_call", " (no function calling)")
    fmt = request.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise unsupported("response_format", ': only {"type": "text"} is served')
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
        if message.role == "assistant":
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


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """`messages` as the chat template wants them, checking roles and tool fields."""
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = _TEMPLATE_ROLE.get(message.role)
        if role is None:
            detail = " (no tool calling)" if message.role in ("tool", "function") else ""
            raise invalid(
                f"Invalid value for '{param}.role': {message.role!r}{detail}; expected one "
                "of 'system', 'developer', 'user', 'assistant'.",
                f"{param}.role",
            )
        if message.tool_calls:
            raise unsupported(f"{param}.tool_calls", " (no tool calling)")
        if message.function_call is not None:
            raise unsupported(f"{param}.function_call", " (no function calling)")
        out.append({"role": role, "content": message_text(message, param)})
    return out


def render_prompt(tokenizer: Any, turns: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid(
            "This model has no chat template, so it cannot serve chat completions; "
            "use /v1/completions.",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja TemplateError, ValueError: the template refused them
        raise invalid(
            f"The chat template cannot render these messages: {exc}", "messages"
        ) from None
    return str(text)


class ChatEndpoint(LocalEndpoint[ChatCompletionRequest]):
    """POST /v1/chat/completions on a local engine."""

    prompt_param = "messages"

    def check(self, request: ChatCompletionRequest) -> None:
        check_unsupported(request)

    async def prompts(
        self, runtime: EngineRuntime, request: ChatCompletionRequest, ctx: RequestContext
    ) -> list[list[int]]:
        prompt = render_prompt(runtime.tokenizer, conversation(request.messages))
        ctx.prompt_text = prompt
        return [await encode(runtime.tokenizer, prompt)]

    def requested_max_tokens(self, request: ChatCompletionRequest) -> tuple[int | None, str]:
        if request.max_completion_tokens is not None:
            return request.max_completion_tokens, "max_completion_tokens"
        return request.max_tokens, "max_tokens"

    def logprobs(self, request: ChatCompletionRequest) -> int | None:
        return (request.top_logprobs or 0) if request.logprobs else None

    def body(
        self,
        runtime: EngineRuntime,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        prompts: list[list[int]],
        results: list[ChoiceResult],
    ) -> dict[str, Any]:
        return _body(runtime, request, ctx, results).model_dump(mode="json")

    def chunks(
        self,
        runtime: EngineRuntime,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        prompts: list[list[int]],
        stream: RequestStream,
    ) -> AsyncGenerator[str, None]:
        return _chunks(runtime, request, ctx, stream)


def _body(
    runtime: EngineRuntime,
    request: ChatCompletionRequest,
    ctx: RequestContext,
    results: list[ChoiceResult],
) -> ChatCompletionResponse:
    num_top = request.top_logprobs or 0
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=r.text),
            logprobs=chat_logprobs(r.logprobs, runtime.token_text, num_top)
            if request.logprobs
            else None,
            finish_reason=r.finish_reason,
        )
        for i, r in enumerate(results)
    ]
    completion_tokens = sum(r.num_output_tokens for r in results)
    return ChatCompletionResponse(
        id=f"chatcmpl-{ctx.request_id}",
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=UsageInfo.of(ctx.prompt_tokens, completion_tokens, ctx.cached_tokens),
    )


async def _chunks(
    runtime: EngineRuntime,
    request: ChatCompletionRequest,
    ctx: RequestContext,
    stream: RequestStream,
) -> AsyncGenerator[str, None]:
    """Role chunk per choice, content deltas, a finish chunk per choice, [usage]."""
    include_usage = request.include_usage
    num_top = request.top_logprobs or 0

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(
            id=f"chatcmpl-{ctx.request_id}",
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
        )
        return body.model_dump_json(exclude=None if include_usage else {"usage"})

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
            if output.text or logprobs is not None:
                delta = DeltaMessage(content=output.text)
                yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
            if output.finished:
                final = ChatChunkChoice(
                    index=index, delta=DeltaMessage(), finish_reason=output.finish_reason
                )
                yield chunk([final])
        if include_usage:
            yield chunk(
                [], UsageInfo.of(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)
            )
    finally:
        stream.close()
