"""One request as a local endpoint's hooks see it (gateway/api/serving.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.api.outputs.plan import OutputPlan
from gateway.context import RequestContext

RequestT = TypeVar("RequestT")


@dataclass
class LocalRequest(Generic[RequestT]):
    """What the client sent, its context, and what the pipeline has derived from it so far:
    the output plan, then the prompts. One object instead of the four threaded through every
    hook by hand (mini-sglang's `Req`)."""

    #: the endpoint's validated request model
    request: RequestT
    ctx: RequestContext
    #: set once the endpoint's `plan` hook has answered
    plan: OutputPlan = field(default_factory=OutputPlan)
    #: the prompts as token ids, set once the `prompts` hook has answered
    prompts: list[list[int]] = field(default_factory=list)
