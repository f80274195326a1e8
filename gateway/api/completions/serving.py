"""POST /v1/completions on a local engine: prompt(s) -> tokens -> engine -> a
`text_completion` body or chunks. Choice `p * n + i` is the i-th choice of prompt p.
`response_format` and vLLM's `structured_outputs` constrain every choice (no tools here)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from gateway.api.chunk_template import TextChunks
from gateway.api.errors import invalid, unsupported
from gateway.api.local_request import LocalRequest
from gateway.api.logprobs import completion_logprobs, text_length
from gateway.api.outputs.plan import OutputPlan, completion_plan, has_schemas, off_loop
from gateway.api.pipeline import (
    ChoiceResult,
    EngineRuntime,
    accept_output,
    check_token_ids,
    encode,
)
from gateway.api.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from gateway.api.serving import LocalEndpoint
from schedulers.client import RequestStream


def check_unsupported(request: CompletionRequest) -> None:
    if request.suffix:
        raise unsupported("suffix", " (no insertion)")
    if request.best_of is not None and request.best_of != request.n:
        raise unsupported("best_of", " unless it equals n")
    if request.echo and request.logprobs is not None:
        raise invalid(
            "echo together with logprobs is not supported (prompt logprobs are not computed).",
            "echo",
        )


async def tokenize_prompts(runtime: EngineRuntime, request: CompletionRequest) -> list[list[int]]:
    """The prompt as token id lists, whichever of the four OpenAI forms it came in."""
    prompt, special = request.prompt, request.add_special_tokens
    if isinstance(prompt, str):
        prompts = [await encode(runtime.tokenizer, prompt, add_special_tokens=special)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [
            await encode(runtime.tokenizer, str(p), add_special_tokens=special) for p in prompt
        ]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt if isinstance(p, list)]
    else:
        prompts = [[int(t) for t in prompt if isinstance(t, int)]]
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise invalid("The prompt is empty.", where)
        check_token_ids(ids, runtime.vocab_size, where)
    return prompts


class CompletionEndpoint(LocalEndpoint[CompletionRequest]):
    """POST /v1/completions on a local engine."""

    prompt_param = "prompt"

    def check(self, request: CompletionRequest) -> None:
        check_unsupported(request)

    async def plan(self, req: LocalRequest[CompletionRequest]) -> OutputPlan:
        if has_schemas(req.request):
            return await off_loop(completion_plan, req.request)
        return completion_plan(req.request)

    async def prompts(self, req: LocalRequest[CompletionRequest]) -> list[list[int]]:
        if isinstance(req.request.prompt, str):
            req.ctx.outcome.record_prompt(req.request.prompt)
        return await tokenize_prompts(self.runtime, req.request)

    def requested_max_tokens(self, request: CompletionRequest) -> tuple[int | None, str]:
        return request.max_tokens, "max_tokens"

    def logprobs(self, request: CompletionRequest) -> int | None:
        return request.logprobs

    def body(
        self, req: LocalRequest[CompletionRequest], results: list[ChoiceResult]
    ) -> dict[str, Any]:
        echoes = _echo_texts(self.runtime, req)
        return _body(self.runtime, req, results, echoes).model_dump(mode="json")

    def chunks(
        self, req: LocalRequest[CompletionRequest], stream: RequestStream
    ) -> AsyncGenerator[str, None]:
        return _chunks(self.runtime, req, stream, _echo_texts(self.runtime, req))


def _echo_texts(runtime: EngineRuntime, req: LocalRequest[CompletionRequest]) -> list[str]:
    """Per choice, the prompt text to prepend ("" without echo)."""
    request, prompts = req.request, req.prompts
    if not request.echo:
        return [""] * (len(prompts) * request.n)
    prompt = request.prompt
    if isinstance(prompt, str):
        texts = [prompt]
    elif all(isinstance(p, str) for p in prompt):
        texts = [str(p) for p in prompt]
    else:
        texts = [str(runtime.tokenizer.decode(ids)) for ids in prompts]
    return [text for text in texts for _ in range(request.n)]


def _body(
    runtime: EngineRuntime,
    req: LocalRequest[CompletionRequest],
    results: list[ChoiceResult],
    echoes: list[str],
) -> CompletionResponse:
    request, ctx = req.request, req.ctx
    choices = [
        CompletionChoice(
            index=i,
            text=echoes[i] + r.text,
            logprobs=None
            if request.logprobs is None
            else completion_logprobs(r.logprobs, runtime.token_text, request.logprobs),
            finish_reason=r.finish_reason,
        )
        for i, r in enumerate(results)
    ]
    completion_tokens = sum(r.num_output_tokens for r in results)
    return CompletionResponse(
        id=f"cmpl-{ctx.request_id}",
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=UsageInfo.of(ctx.prompt_tokens, completion_tokens, ctx.cached_tokens),
    )


async def _chunks(
    runtime: EngineRuntime,
    req: LocalRequest[CompletionRequest],
    stream: RequestStream,
    echoes: list[str],
) -> AsyncGenerator[str, None]:
    """[Echoed prompt per choice], text deltas, a finish chunk per choice, [usage]."""
    request, ctx = req.request, req.ctx
    include_usage = request.include_usage
    offsets = [0] * len(echoes)

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        body = CompletionResponse(
            id=f"cmpl-{ctx.request_id}",
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
        )
        return body.model_dump_json(exclude=None if include_usage else {"usage"})

    texts = TextChunks(lambda index, text: chunk([CompletionChoice(index=index, text=text)]))
    try:
        for index, echo in enumerate(echoes):
            if echo:
                offsets[index] = len(echo)
                yield chunk([CompletionChoice(index=index, text=echo)])
        async for index, output in stream:
            accept_output(runtime, ctx, output)
            logprobs = None
            if request.logprobs is not None and output.logprobs:
                logprobs = completion_logprobs(
                    output.logprobs, runtime.token_text, request.logprobs, offsets[index]
                )
                offsets[index] = text_length(logprobs)
            if logprobs is not None:
                yield chunk([CompletionChoice(index=index, text=output.text, logprobs=logprobs)])
            elif output.text:
                yield texts(index, output.text)
            if output.finished:
                final = CompletionChoice(index=index, text="", finish_reason=output.finish_reason)
                yield chunk([final])
        if include_usage:
            yield chunk(
                [], UsageInfo.of(ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens)
            )
    finally:
        stream.close()
