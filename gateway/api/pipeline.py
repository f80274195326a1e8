"""Pipeline steps shared by the local endpoints: request -> SamplingParams -> engine stream.

`EngineRuntime` is what a pipeline needs from a local arm: the engine, its tokenizer and
the serving limits. Engine exceptions become OpenAI errors here: AdmissionError -> 400
(`context_length_exceeded`), EngineDeadError -> 503 (`server_shutting_down` after a
deliberate stop), a full waiting queue or a `queue_timeout` -> 429. docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import anyio
import structlog

from gateway.api.errors import (
    SHUTTING_DOWN,
    APIError,
    context_length_exceeded,
    invalid,
    overloaded,
    server_error,
    unavailable,
    unsupported,
)
from gateway.api.outputs.tools import template_renders_tools
from gateway.api.protocol import MAX_ARRAY_ITEMS, MAX_STOP_SEQUENCES, SamplingRequest
from gateway.api.sampling_defaults import SamplingDefaults, sampling_fields
from gateway.context import ClientDisconnected, RequestContext
from gateway.settings.groups import GENERATION_CONFIG_AUTO
from schedulers.base import AdmissionError
from schedulers.client import RequestStream
from schedulers.client import open_stream as open_engine_stream
from schedulers.engine import Engine, EngineDeadError
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import DEADLINE_EXCEEDED, QUEUE_TIMEOUT, TokenLogprob
from schedulers.structured_output import GrammarCompiler

log = structlog.get_logger("carousel.gateway")

#: texts longer than this are tokenized on a worker thread, off the event loop
_THREAD_TOKENIZE_CHARS = 8192
#: choices (prompts x n) one request may ask for
MAX_CHOICES = MAX_ARRAY_ITEMS


@dataclass(frozen=True)
class ServingOptions:
    """Limits a local arm applies to every request.

    `max_prompt_tokens` (None: the context window) refuses longer prompts with 400
    `context_length_exceeded`; `max_waiting_requests` (None: unbounded) answers 429 while
    that many sequences wait in the engine. `generation_config` says whose sampling defaults
    a request's unset fields take: `auto` (the model's), `vllm` (OpenAI's) or a folder
    (gateway/api/sampling_defaults.py).
    """

    default_max_tokens: int = 4096
    max_waiting_requests: int | None = None
    retry_after_s: int = 1
    disconnect_poll_s: float = 0.1
    max_prompt_tokens: int | None = None
    generation_config: str = GENERATION_CONFIG_AUTO


@dataclass
class EngineRuntime:
    """A started engine with its tokenizer, as the pipelines see it, and what a request's
    unset sampling fields become (`sampling_defaults`)."""

    engine: Engine
    options: ServingOptions
    scheduler: str
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    token_text: Callable[[int], str] = field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.tokenizer
        self.token_text = lru_cache(maxsize=1 << 16)(lambda t: str(tokenizer.decode([t])))

    @property
    def tokenizer(self) -> Any:
        return self.engine.backend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @functools.cached_property
    def vocab_size(self) -> int:
        # NOTE: read once: `len()` of a fast tokenizer asks the Rust side, which releases the
        # GIL, so each call waited for the device thread's next release (py-spy on a Gemma 3
        # burst: 0.8 s of the event loop's time in it, two calls a request)
        return len(self.tokenizer)

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The arm's `GrammarCompiler` (None: this backend cannot constrain outputs)."""
        return self.engine.grammar_compiler

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows `tools=` itself (else the tool prompt does)."""
        return template_renders_tools(self.tokenizer)


@dataclass
class ChoiceResult:
    """One choice accumulated from its outputs (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        if output.finished:
            self.finish_reason = output.finish_reason
            self.num_output_tokens = output.num_output_tokens


# -- request -> SamplingParams ------------------------------------------------------------


def log_ignored_fields(request: SamplingRequest, ctx: RequestContext) -> None:
    """One log line naming the unknown fields of `request` (they are ignored)."""
    if request.model_extra:
        log.info(
            "ignored_unknown_fields", request_id=ctx.request_id, fields=sorted(request.model_extra)
        )


def check_stream_options(request: SamplingRequest) -> None:
    if getattr(request, "stream_options", None) is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true.", "stream_options")


def parse_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences.", "stop")
    return tuple(s for s in stops if s)


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(
                f"logit_bias keys must be token ids, got {key!r}.", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1}).",
                "logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value}.", "logit_bias")
        out[token_id] = value
    return out


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1}).", param)


def context_budget(
    requested: int | None,
    requested_param: str,
    num_prompt_tokens: int,
    runtime: EngineRuntime,
    prompt_param: str,
) -> int:
    """max_tokens for the engine: as asked, else min(default, what the context has left).

    NOTE: the gateway's one context-length check (the engine guards its own admission).
    Raises `context_length_exceeded` naming the param at fault: `requested_param` when the
    asked budget alone exceeds the window, `prompt_param` when the prompt is over
    `max_prompt_tokens` or prompt + completion exceed the window.
    """
    limit = runtime.max_model_len
    source = "messages" if prompt_param == "messages" else "prompt"
    cap = runtime.options.max_prompt_tokens
    if cap is not None and cap < limit and num_prompt_tokens > cap:
        raise context_length_exceeded(
            f"This server accepts at most {cap} prompt tokens. However, your {source} has "
            f"{num_prompt_tokens} tokens. Please reduce the length of the {source}.",
            prompt_param,
        )
    if requested is not None and requested > limit:
        raise context_length_exceeded(
            f"{requested_param} is too large: {requested}. This model's maximum context "
            f"length is {limit} tokens (prompt and completion together).",
            requested_param,
        )
    left = limit - num_prompt_tokens
    max_tokens = (
        requested if requested is not None else min(runtime.options.default_max_tokens, left)
    )
    if left < 1 or num_prompt_tokens + max_tokens > limit:
        raise context_length_exceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max(max_tokens, 1)} tokens ({num_prompt_tokens} in the "
            f"{source}, {max(max_tokens, 1)} in the completion). Please reduce the length of "
            f"the {source} or completion.",
            prompt_param,
        )
    return max_tokens


def sampling_params(
    request: SamplingRequest, runtime: EngineRuntime, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The engine's SamplingParams for `request` (the arm's `sampling_defaults` where a
    field is absent, else OpenAI's); `max_tokens` comes from `context_budget`."""
    stop_token_ids = list(request.stop_token_ids or [])
    check_token_ids(stop_token_ids, runtime.vocab_size, "stop_token_ids")
    if not request.skip_special_tokens:
        raise unsupported("skip_special_tokens", ": special tokens are always skipped")
    defaults = runtime.sampling_defaults
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        **sampling_fields(request, defaults),
        "seed": request.seed,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "logit_bias": parse_logit_bias(request.logit_bias, runtime.vocab_size),
        "logprobs": logprobs,
        "stop": parse_stop(request.stop),
        "stop_token_ids": tuple(stop_token_ids),
        "ignore_eos": request.ignore_eos,
        "n": request.n,
    }
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # NOTE: pydantic checked the ranges; this is a backstop
        param = next((name for name in kwargs if str(exc).startswith(name)), None)
        raise invalid(str(exc), param) from None


async def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; special tokens (a BOS) added only where asked: a chat template
    already holds them, a completions prompt does not (vLLM's `add_special_tokens`)."""
    if len(text) > _THREAD_TOKENIZE_CHARS:
        ids = await anyio.to_thread.run_sync(
            lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )
    else:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(ids)


# -- engine -------------------------------------------------------------------------------


def open_stream(
    runtime: EngineRuntime,
    ctx: RequestContext,
    prompts: list[list[int]],
    params: SamplingParams,
    param: str,
    priority: int = 0,
) -> RequestStream:
    """Submit to the engine, mapping refusals to OpenAI errors (400, 429, 503)."""
    engine, options = runtime.engine, runtime.options
    num_choices = len(prompts) * params.n
    if num_choices > MAX_CHOICES:
        raise invalid(
            f"This request asks for {num_choices} choices ({len(prompts)} prompts x n="
            f"{params.n}); at most {MAX_CHOICES} are allowed.",
            "n" if params.n > 1 else param,
        )
    if not engine.is_alive:
        raise _engine_unavailable(engine, options.retry_after_s)
    limit = options.max_waiting_requests
    if limit is not None and engine.num_waiting >= limit:
        raise overloaded(
            f"The server is busy: {engine.num_waiting} requests are already waiting. "
            "Please retry shortly.",
            options.retry_after_s,
        )
    try:
        return open_engine_stream(engine, ctx.engine_request_id, prompts, params, priority)
    except AdmissionError as exc:
        if exc.code == "context_length_exceeded":
            raise context_length_exceeded(str(exc), param) from None
        raise invalid(str(exc), param, exc.code) from None
    except EngineDeadError:
        raise _engine_unavailable(engine, options.retry_after_s) from None


def _engine_unavailable(engine: Engine, retry_after_s: int) -> APIError:
    if engine.was_stopped and engine.dead_reason is None:
        return unavailable(
            "The server is shutting down and could not finish this request. Please retry.",
            retry_after_s,
            SHUTTING_DOWN,
        )
    reason = engine.dead_reason or "the engine is not running"
    return unavailable(f"The model is not available: {reason}", retry_after_s, "engine_dead")


def output_error(runtime: EngineRuntime, output: RequestOutput) -> APIError | None:
    """The error a finished output carries, if any: 429 for a queue timeout or a missed
    deadline (`edf`), 503 when the engine stopped or died, else 500."""
    if output.finish_reason != "error":
        return None
    retry_after_s = runtime.options.retry_after_s
    if output.error_code in (QUEUE_TIMEOUT, DEADLINE_EXCEEDED):
        return overloaded(
            f"The server is busy: {output.error}. Please retry shortly.",
            retry_after_s,
            output.error_code,
        )
    if not runtime.engine.is_alive:
        return _engine_unavailable(runtime.engine, retry_after_s)
    log.error("engine_request_failed", request_id=output.request_id, error=output.error)
    return server_error("The engine failed while running this request.")


def record_output(ctx: RequestContext, output: RequestOutput) -> None:
    """Account one output in the request's log line (first token time, finish reasons)."""
    if output.token_ids:
        ctx.outcome.record_token(ctx.start)
        ctx.outcome.add_completion_tokens(len(output.token_ids))
    if output.finished and output.finish_reason is not None:
        # NOTE: prompt_tokens counts each prompt once; so do the cached tokens
        cached = output.num_cached_tokens if output.index == 0 else 0
        ctx.outcome.record_finish(output.finish_reason, cached)


def accept_output(runtime: EngineRuntime, ctx: RequestContext, output: RequestOutput) -> None:
    """Record `output` in the request's accounting; raise the error it carries, if any."""
    record_output(ctx, output)
    error = output_error(runtime, output)
    if error is not None:
        raise error


async def collect(
    runtime: EngineRuntime, stream: RequestStream, ctx: RequestContext, num_choices: int
) -> list[ChoiceResult]:
    """Read every choice to its end, aborting if the client disconnects meanwhile."""
    results = [ChoiceResult() for _ in range(num_choices)]

    async def read() -> None:
        async for index, output in stream:
            accept_output(runtime, ctx, output)
            results[index].add(output)

    task = asyncio.ensure_future(read())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=runtime.options.disconnect_poll_s)
            if not task.done() and await ctx.is_disconnected():
                raise ClientDisconnected()
        task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stream.close()
    return results
