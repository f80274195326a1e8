"""What an OpenAI endpoint is, declared once: its path, request model, metrics label, how its
stream is framed, and how a local engine serves it.

The table of served endpoints is gateway/api/table.py. An arm serves any of them through
one method (`Arm.serve(endpoint, request, ctx, services)`): a local arm runs the pipeline
`endpoint.local` builds over its engine, an upstream arm forwards the body to
`endpoint.upstream_path` with no per-endpoint code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from pydantic import BaseModel

if TYPE_CHECKING:
    from gateway.api.pipeline import EngineRuntime
    from gateway.context import RequestContext

#: a non-streaming reply is the response body; a streaming one yields chunk payloads (JSON)
Reply: TypeAlias = dict[str, Any] | AsyncIterator[str]


class LocalPipeline(Protocol):
    """How one local engine serves one endpoint's requests."""

    async def __call__(self, request: Any, ctx: RequestContext) -> Reply:
        """The reply to `request` (already validated as the endpoint's request model)."""
        ...


#: builds an endpoint's pipeline over one arm's engine (a `LocalEndpoint` subclass)
PipelineFactory: TypeAlias = Callable[["EngineRuntime"], LocalPipeline]


@dataclass(frozen=True)
class StreamFormat:
    """How the endpoint's stream is framed as Server-Sent Events.

    `event_lines`: each payload is preceded by `event: <its "type">` (the Responses API);
    `done`: the stream ends with `data: [DONE]` (chat and completions); `closing_events`: the
    event types after which at most an in-band error follows (keep-alive pings stop there).
    """

    event_lines: bool = False
    done: bool = True
    closing_events: frozenset[str] = frozenset()


#: chat and completions: data-only events, then `data: [DONE]`
OPENAI_CHUNKS = StreamFormat()
#: the Responses API: `event: <type>` lines, no `[DONE]`
TYPED_EVENTS = StreamFormat(
    event_lines=True,
    done=False,
    closing_events=frozenset({"response.completed", "response.incomplete", "response.failed"}),
)


@dataclass(frozen=True)
class Endpoint:
    """One POST endpoint of the OpenAI API, as every layer of the gateway sees it."""

    #: the `endpoint` label of its metrics and access log lines
    name: str
    #: the route, e.g. /v1/chat/completions
    path: str
    request_model: type[BaseModel]
    #: its pipeline on a local arm, given that arm's engine
    local: PipelineFactory
    stream_format: StreamFormat = OPENAI_CHUNKS
    #: whether an upstream is asked for usage with `stream_options.include_usage`
    usage_via_stream_options: bool = True

    @property
    def upstream_path(self) -> str:
        """The path under an upstream's base URL (which ends where /v1 paths begin)."""
        return self.path.removeprefix("/v1")
