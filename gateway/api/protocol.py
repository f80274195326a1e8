"""Pydantic models of the OpenAI wire format: requests in, bodies and stream chunks out.

Requests allow unknown fields (they land in `model_extra`, are logged and ignored, as vLLM
does). Fields we know but do not implement (functions, audio, ...) are declared so
that `unsupported_fields` can refuse them by name instead of silently dropping them.
Range checks and size limits live here (Field constraints and field validators) so pydantic
names the param; cross-field rules are in `check_*` functions (raising `errors.invalid`).
The limits (OpenAI's where it has one) keep one request's cost bounded: see
docs/reliability.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from gateway.api.bounds import Metadata, User

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256
#: messages in one chat request, prompts in one completions request (OpenAI's array limit)
MAX_ARRAY_ITEMS = 2048


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` has a meaning here."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ContentPart(BaseModel):
    """One part of an array `content`; only `{"type": "text", "text": ...}` is served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of `messages`; `role` and the part types are checked in serving_chat."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    tool_call_id: str | None = None


class SamplingRequest(_Request):
    """Parameters shared by chat and completions (OpenAI's plus vLLM-style extensions)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: User | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    #: lower runs first under the `priority` policy (vLLM's field); other policies ignore it
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    #: constrained decoding as vLLM spells it (`json`, `regex`, `choice`, `grammar`, ...)
    structured_outputs: Any = None
    #: `{"type": "text" | "json_object" | "json_schema", ...}` (docs/structured-outputs.md)
    response_format: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _limit(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _limit(f"each stop sequence may be at most {MAX_STOP_CHARS} characters long")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bound_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is not None and len(bias) > MAX_LOGIT_BIAS:
            raise _limit(f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}")
        return bias


def _limit(message: str) -> PydanticCustomError:
    """A validation error whose message is exactly `message` (no "Value error," prefix)."""
    return PydanticCustomError("limit_exceeded", message)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ARRAY_ITEMS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: function tools and the choice among them (validated in gateway/api/outputs/tools.py)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # known, not implemented: refused by name when set to anything meaningful
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    @property
    def completion_budget(self) -> int | None:
        """`max_completion_tokens` supersedes the deprecated `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[list[int]] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    #: vLLM's extension: the tokenizer's special tokens (a BOS, as HF `generate` callers and
    #: llama.cpp add) around a text prompt; token-id prompts are taken as they are
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _bound_prompts(
        cls, prompt: str | list[int] | list[list[int]] | list[str]
    ) -> str | list[int] | list[list[int]] | list[str]:
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if batched and len(prompt) > MAX_ARRAY_ITEMS:
            raise _limit(f"at most {MAX_ARRAY_ITEMS} prompts are allowed, got {len(prompt)}")
        return prompt


# -- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: of the prompt tokens, those the prefix cache served."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """Usage with the total derived from its two parts."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """`content` is None when the model only called tools (`tool_calls` then set)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body: dict[str, Any] = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """A streamed delta: keys that are None are left out (`{}` for the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    #: `ToolCallDelta.as_openai()` entries
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole body and each stream chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "carousel"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
