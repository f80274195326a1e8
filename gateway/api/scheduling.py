"""What the scheduler is told about who sent a request, and what that sender may ask of it.

- **Whom it is served for** (`SamplingParams.principal`, the key `fair` shares service by):
  the principal its API key resolves to. The request's `user` only on a gateway without keys,
  where there is no principal to key on. So one key's requests are one principal whatever
  `user` they send, and two keys are two principals even with the same `user`.
- **Its `priority` and first-token deadline** (`X-Carousel-Deadline-Ms`), within its
  principal's caps from the key file (`min_priority`, `min_deadline_ms`;
  gateway/settings/principals.py). Asking beyond a cap is a 400 naming the field (never
  silently changed); a request that asks nothing gets no more than its cap: it runs at
  priority max(0, `min_priority`), and `edf` gives it no deadline before `min_deadline_ms`.
  A principal without caps is served as before.

The route bounds a request (`bound_request`) before any arm is chosen, so the refusals hold
on every arm; the floors are for local arms (an upstream arm gets the body as sent). A shadow
copy has no route: it runs as `anonymous` (keyed on `user`) at its body's own `priority`.
`user` keeps its other job: the sticky arm choice (gateway/arms/choice.py) is per end user.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from gateway.api.errors import APIError, invalid
from gateway.context import RequestContext
from gateway.settings.principals import ANONYMOUS_NAME, Principal

#: the first token's deadline, in ms after arrival, for deadline-aware policies (`edf`)
DEADLINE_HEADER = "X-Carousel-Deadline-Ms"


def served_for(principal: str, user: str | None) -> str | None:
    """Whom the scheduler serves a request for: its API key's principal, else its `user`."""
    return principal if principal != ANONYMOUS_NAME else user


def bound_request(
    ctx: RequestContext, request: BaseModel, principal: Principal, header: str | None
) -> RequestContext:
    """`ctx` with the request's deadline and priority, within `principal`'s caps (400
    naming the header or `priority` for a request that asks beyond them)."""
    deadline = deadline_ms(header)
    cap = principal.min_deadline_ms
    if deadline is not None and cap is not None and deadline < cap:
        raise _beyond_cap(
            f"This API key may ask for a first-token deadline of at least {cap:g} ms; "
            f"{DEADLINE_HEADER} is {deadline:g}.",
            DEADLINE_HEADER,
        )
    priority = bounded_priority(requested_priority(request), principal.min_priority)
    return replace(ctx, deadline_ms=deadline, min_deadline_ms=cap, priority=priority)


def deadline_ms(value: str | None) -> float | None:
    """The `X-Carousel-Deadline-Ms` header as a positive number of ms (None when absent)."""
    if value is None:
        return None
    try:
        deadline = float(value)
    except ValueError:
        deadline = -1.0
    if not 0 < deadline < float("inf"):
        raise invalid(
            f"{DEADLINE_HEADER} must be a positive number of milliseconds, got {value!r}.",
            DEADLINE_HEADER,
        )
    return deadline


def requested_priority(request: BaseModel) -> int | None:
    """The `priority` a request sets (chat and completions declare it; None: it sets none).

    NOTE: only the declared field: an unknown `priority` (a Responses body's) is ignored."""
    if "priority" not in type(request).model_fields or "priority" not in request.model_fields_set:
        return None
    return int(getattr(request, "priority"))  # noqa: B009 - not every request model has it


def bounded_priority(asked: int | None, cap: int | None) -> int:
    """The priority a request runs at: as asked (400 when more urgent than `cap`), else 0,
    or `cap` when that is less urgent."""
    if cap is None:
        return 0 if asked is None else asked
    if asked is None:
        return max(0, cap)
    if asked < cap:
        raise _beyond_cap(
            f"This API key may ask for a priority of {cap} or above (lower runs first); "
            f"priority is {asked}.",
            "priority",
        )
    return asked


def scheduled_priority(ctx: RequestContext, request: BaseModel) -> int:
    """The priority to submit: the one the route bounded, else (a shadow copy, which has no
    route) the request's own."""
    if ctx.priority is not None:
        return ctx.priority
    return requested_priority(request) or 0


def _beyond_cap(message: str, param: str) -> APIError:
    return invalid(message, param, "beyond_principal_limit")
