"""Pydantic models of the Responses API (`POST /v1/responses`): the request, the response
object, and the typed stream events (/work/shared/openai-wire.md, "Responses API").

The request keeps `input`, `tools` and `tool_choice` loosely typed: `responses_convert`
walks them and names the exact `param` of what is wrong or not served. `unsupported` refuses,
by name, the fields whose meaning Carousel does not implement (built-in tools, reasoning,
background, ...) instead of dropping them. The output models validate as the `openai` SDK's
`Response` and `ResponseStreamEvent` types (tests/test_responses_api.py checks that).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.api.bounds import Metadata, User
from gateway.api.problems import ParamProblem

#: input items in one request (OpenAI's array limit)
MAX_INPUT_ITEMS = 2048

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: `resp_`, `msg_` or `fc_` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields land in `model_extra` (logged and ignored)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    #: one string (one item, however long) or a list of at most MAX_INPUT_ITEMS items
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: Metadata | None = None
    user: User | None = None
    # known, not served: refused by `unsupported` when set to anything meaningful
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def unsupported(request: ResponsesRequest) -> ParamProblem | None:
    """The first field set to something Carousel does not serve, as a 400 naming it."""
    reasoning = request.reasoning or {}
    checks: list[tuple[bool, str, str]] = [
        (bool(request.background), "background", " (responses run in the foreground)"),
        (any(v is not None for v in reasoning.values()), "reasoning", " (no reasoning models)"),
        (bool(request.include), "include", ""),
        (request.conversation is not None, "conversation", "; use previous_response_id"),
        (request.prompt is not None, "prompt", " (no stored prompts)"),
        (request.truncation not in (None, "disabled"), "truncation", ": only 'disabled'"),
        (request.max_tool_calls is not None, "max_tool_calls", ""),
        (bool(request.top_logprobs), "top_logprobs", ""),
    ]
    for is_set, param, detail in checks:
        if is_set:
            return ParamProblem(
                param,
                f"'{param}' is not supported by this server{detail}.",
                "unsupported_parameter",
            )
    for i, tool in enumerate(request.tools or []):
        kind = tool.get("type")
        if kind != "function":
            return ParamProblem(
                f"tools[{i}].type",
                f"Built-in tools such as {kind!r} are not supported by this server; "
                "only 'function' tools are.",
                "unsupported_parameter",
            )
    return None


# -- the response object -------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = Annotated[OutputMessage | FunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the SDK (3.x) requires it; Carousel writes no prompt cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The response (`object: "response"`), as returned, stored and streamed."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None

    @property
    def output_text(self) -> str:
        """All output text joined (the SDK's `response.output_text`)."""
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )


def deleted_body(response_id: str) -> dict[str, Any]:
    """The body of `DELETE /v1/responses/{id}`."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# -- stream events (each has a rising `sequence_number`) -----------------------------------


class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    """created / in_progress / completed / incomplete / failed: the whole response."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


ResponseStreamEvent = (
    ResponseLifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
)


def to_sse(event: ResponseStreamEvent) -> str:
    """One event as SSE: an `event:` line with its type, then its JSON (no `[DONE]` after
    the last one, as OpenAI)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
