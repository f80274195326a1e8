"""The load generator: streamed OpenAI requests sent on an arrival schedule, timed per chunk.

Times are `time.perf_counter()` seconds; a request's clock starts just before its HTTP request
is sent (after any `--max-concurrency` wait, as in vLLM's bench) and stops when the stream ends.
`timeout_s` bounds a whole request, stream included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from bench.workload import RequestSpec

Endpoint = Literal["chat", "completions", "responses"]
ARM_HEADER = "X-Carousel-Arm"
DEADLINE_HEADER = "X-Carousel-Deadline-Ms"
ENDPOINT_PATHS: dict[Endpoint, str] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "responses": "/responses",
}
#: Responses API stream events whose `delta` is generated text (or call arguments)
_RESPONSES_TEXT_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.refusal.delta",
    }
)
#: Responses API events that end a stream (it has no `data: [DONE]`)
_RESPONSES_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send requests."""

    api_base: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: Endpoint = "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    #: the bench's own requests' sampling temperature (0: greedy; a replayed body keeps its own)
    temperature: float = 0.0
    timeout_s: float = 600.0
    max_concurrency: int | None = None


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; `None` when the event never happened."""

    index: int
    max_tokens: int
    send_time: float | None = None  # seconds after the run started
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0
    usage_output_tokens: int | None = None
    prompt_tokens: int | None = None
    #: of the prompt tokens, those the server served from its prefix cache (usage's
    #: `prompt_tokens_details.cached_tokens`; None when it does not say)
    cached_tokens: int | None = None
    target_input_len: int | None = None
    turn: int | None = None  # multi-turn: this request's turn in its conversation
    user: str | None = None  # the `user` it was sent for (`--users`)
    deadline_ms: float | None = None  # its own TTFT objective (`--deadline-mix`)
    text: str = ""  # the answer as received (a conversation's next turn resends it)
    success: bool = False
    cancelled: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Ended one way or another (success, error, or cancelled)."""
        return self.success or self.cancelled or self.error is not None

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count, else the number of content chunks."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return self.num_chunks


@dataclass
class RunOutcome:
    """The results of one arm at one rate, and its window in wall-clock and run time."""

    results: list[RequestResult]
    start_wall: float
    end_wall: float
    duration_s: float
    interrupted: bool


def endpoint_of(cfg: ClientConfig, spec: RequestSpec) -> Endpoint:
    """The spec's own endpoint (a replayed request), else the run's."""
    return spec.endpoint or cfg.endpoint


def build_body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body of one streamed request.

    A replayed request (`spec.body`) keeps its body, with streaming turned on (and usage
    asked for, except on /v1/responses, whose final event carries it).
    """
    if spec.body is not None:
        replayed = dict(spec.body)
        replayed["stream"] = True
        if endpoint_of(cfg, spec) != "responses":
            options = replayed.get("stream_options")
            replayed["stream_options"] = {**(options or {}), "include_usage": True}
        if not cfg.ignore_eos:
            replayed.pop("ignore_eos", None)  # --no-ignore-eos, or an arm that refuses it
        return replayed
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = spec.as_messages()
    elif cfg.endpoint == "responses":
        body["input"] = spec.as_messages()
        body["max_output_tokens"] = body.pop("max_tokens")
        del body["stream_options"]
    else:
        body["prompt"] = spec.as_prompt()
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if spec.user is not None:
        body["user"] = spec.user
    return body


def build_headers(
    cfg: ClientConfig, arm: str | None, deadline_ms: float | None = None
) -> dict[str, str]:
    """Auth, arm-selection and deadline headers."""
    headers = {"Accept": "text/event-stream"}
    if deadline_ms is not None:
        headers[DEADLINE_HEADER] = f"{deadline_ms:g}"
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    if arm is not None:
        headers[ARM_HEADER] = arm
    return headers


def chunk_text(chunk: dict[str, Any], endpoint: Endpoint) -> str:
    """The generated text a stream chunk carries: chat `delta.content` (or tool-call argument
    fragments), completion `text`, or a Responses text/arguments `delta` event."""
    if endpoint == "responses":
        delta = chunk.get("delta") if chunk.get("type") in _RESPONSES_TEXT_EVENTS else None
        return delta if isinstance(delta, str) else ""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint != "chat":
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta") or {}
    text = delta.get("content")
    if isinstance(text, str) and text:
        return text
    calls = delta.get("tool_calls") or []
    fragments = [(c.get("function") or {}).get("arguments") for c in calls if isinstance(c, dict)]
    return "".join(f for f in fragments if isinstance(f, str))


def chunk_usage(chunk: dict[str, Any], endpoint: Endpoint) -> dict[str, Any] | None:
    """`{"prompt_tokens", "completion_tokens"}` when the chunk reports usage, else None."""
    if endpoint == "responses":
        response = chunk.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if chunk.get("type") not in _RESPONSES_FINAL_EVENTS or not isinstance(usage, dict):
            return None
        return {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
        }
    usage = chunk.get("usage")
    return usage if isinstance(usage, dict) else None


def chunk_error(chunk: dict[str, Any], endpoint: Endpoint) -> str | None:
    """The message of an in-stream error event, else None."""
    if endpoint == "responses":
        kind = chunk.get("type")
        if kind == "error":
            return str(chunk.get("message") or _error_message(chunk))
        if kind == "response.failed":
            response = chunk.get("response") or {}
            return _error_message(response) if isinstance(response, dict) else "response failed"
        return None
    return _error_message(chunk) if chunk.get("error") is not None else None


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err is not None:
            return str(err)
        if payload.get("detail") is not None:
            return str(payload["detail"])
    return str(payload)[:200]


async def send_request(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    spec: RequestSpec,
    arm: str | None,
    result: RequestResult,
    t0: float,
) -> None:
    """Send one streamed request and fill `result` as chunks arrive."""
    endpoint = endpoint_of(cfg, spec)
    url = cfg.api_base + ENDPOINT_PATHS[endpoint]
    start = time.perf_counter()
    result.send_time = start - t0
    last_content: float | None = None
    try:
        async with (
            asyncio.timeout(cfg.timeout_s),
            client.stream(
                "POST",
                url,
                json=build_body(cfg, spec),
                headers=build_headers(cfg, arm, spec.deadline_ms),
            ) as response,
        ):
            if response.status_code != 200:
                body = await response.aread()
                result.error = f"HTTP {response.status_code}: {_parse_error(body)}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                error = chunk_error(chunk, endpoint)
                if error is not None:
                    result.error = f"in-stream error: {error}"
                    return
                usage = chunk_usage(chunk, endpoint)
                if usage is not None:
                    result.usage_output_tokens = _count(usage.get("completion_tokens"))
                    result.prompt_tokens = _count(usage.get("prompt_tokens"))
                    details = usage.get("prompt_tokens_details") or usage.get(
                        "input_tokens_details"
                    )
                    if isinstance(details, dict):
                        result.cached_tokens = _count(details.get("cached_tokens"))
                    if endpoint == "responses":
                        break  # the final event: the Responses stream has no [DONE]
                text = chunk_text(chunk, endpoint)
                if text:
                    result.text += text
                    if last_content is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last_content)
                    last_content = now
                    result.num_chunks += 1
        result.latency = time.perf_counter() - start
        result.success = True
    except TimeoutError:
        result.error = f"timed out after {cfg.timeout_s:g} s"
    except Exception as exc:  # one bad request must not end the run
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None


def _parse_error(body: bytes) -> str:
    try:
        return _error_message(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        return body[:200].decode("utf-8", "replace")


async def run_requests(
    cfg: ClientConfig,
    specs: list[RequestSpec],
    offsets: list[float],
    arm: str | None,
    stop: asyncio.Event,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunOutcome:
    """Send `specs[i]` at `offsets[i]` seconds after the start; stop early when `stop` is set.

    On `stop`, no new request is sent and the in-flight ones are cancelled (their streams
    closed, so the server can abort them) and marked `cancelled`. The later turns of a
    conversation (`spec.turn > 1`) are not scheduled: each is sent as soon as the previous
    turn's answer arrived, with the history before it; a failed turn ends its conversation.
    """
    results = [
        RequestResult(
            s.index,
            s.max_tokens,
            target_input_len=s.target_input_len,
            turn=s.turn if s.conversation is not None else None,
            user=s.user,
            deadline_ms=s.deadline_ms,
        )
        for s in specs
    ]
    later_turns: dict[int, list[tuple[RequestSpec, RequestResult]]] = {}
    for spec, result in zip(specs, results, strict=True):
        if spec.conversation is not None:
            turns = later_turns.setdefault(spec.conversation, [])
            if spec.turn > 1:
                turns.append((spec, result))
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def send(spec: RequestSpec, result: RequestResult) -> None:
            if semaphore is None:
                await send_request(client, cfg, spec, arm, result, t0)
            else:
                async with semaphore:
                    await send_request(client, cfg, spec, arm, result, t0)
            if on_done is not None:
                on_done(result)

        async def one(spec: RequestSpec, result: RequestResult) -> None:
            await send(spec, result)
            history = spec.as_messages()
            conversation = spec.conversation
            for next_spec, next_result in [] if conversation is None else later_turns[conversation]:
                if not result.success:
                    return
                history = [*history, {"role": "assistant", "content": result.text}]
                history += next_spec.as_messages()
                spec, result = dataclasses.replace(next_spec, messages=history), next_result
                await send(spec, result)

        start_wall = time.time()
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        stop_task = asyncio.create_task(stop.wait())
        for spec, result, offset in zip(specs, results, offsets, strict=True):
            if spec.turn > 1:
                continue  # sent by its conversation, after the turn before it
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.wait({stop_task}, timeout=delay)
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(one(spec, result)))
        if tasks and not stop.is_set():
            all_done = asyncio.create_task(asyncio.wait(tasks))
            await asyncio.wait({stop_task, all_done}, return_when=asyncio.FIRST_COMPLETED)
            all_done.cancel()
        interrupted = stop.is_set()
        for task in (*tasks, stop_task):
            task.cancel()
        await asyncio.gather(*tasks, stop_task, return_exceptions=True)
        duration = time.perf_counter() - t0
        end_wall = time.time()

    for result in results:
        if not result.finished and result.send_time is not None:
            result.cancelled = True
    sent = [r for r in results if r.send_time is not None]
    return RunOutcome(sent, start_wall, end_wall, duration, interrupted)
