"""The model layer: a served model name (`Deployment`) and the arms that can answer for it.

An `Arm` serves any endpoint of the table (gateway/api/table.py) through one method: it
takes a validated OpenAI request and returns either a whole response body or a stream of
chunk payloads (JSON strings, framed as SSE by the route). A `LocalArm`
(gateway/arms/local.py) runs the endpoint's local pipeline on an Engine in this process; an
`UpstreamArm` forwards the body to another OpenAI-compatible server. `Deployment.pick` is
where an A/B split chooses among several arms.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.api.endpoint import Endpoint, Reply
from gateway.api.errors import PERMISSION, APIError, invalid, model_not_found, shown, unavailable
from gateway.arms.arm import Arm
from gateway.arms.choice import ARM_HEADER, choose_by_weight, draw_point
from gateway.arms.shadow import ShadowCopy, ShadowMirror
from gateway.context import RequestContext
from gateway.obs.metrics import ArmGauges, ArmInfo
from gateway.settings.principals import ANONYMOUS, Principal

__all__ = ["Deployment", "Deployments", "Reply"]


@dataclass
class Deployment:
    """A model name clients ask for and the arms that serve it (shadows included)."""

    name: str
    arms: list[Arm]
    created: int = field(default_factory=lambda: int(time.time()))
    #: what the split randomises: each `user` (sticky) or each request (a rollout's setting)
    assignment: Literal["user", "request"] = "user"
    mirrors: list[ShadowMirror] = field(init=False)

    def __post_init__(self) -> None:
        self.mirrors = [ShadowMirror(a, a.shadow_fraction) for a in self.arms if a.shadow]

    @property
    def primaries(self) -> list[Arm]:
        """The arms that take traffic of their own."""
        return [a for a in self.arms if not a.shadow]

    def mirror(self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext) -> None:
        """Offer a copy of an accepted request to every shadow arm (never waits)."""
        for mirror in self.mirrors:
            mirror.offer(ShadowCopy(endpoint, body, ctx.request_id, self.name))

    def pick(
        self,
        ctx: RequestContext,
        retry_after_s: int,
        requested: str | None = None,
        user: str | None = None,
        principal: Principal = ANONYMOUS,
        pinned: str | None = None,
    ) -> Arm:
        """The arm that serves this request (see gateway/arms/choice.py for the rule).

        `requested` is the arm asked for: `pinned` by the client's header (which must be an
        arm `principal` may pin) or the one its conversation continues on."""
        if requested is not None:
            arm = self.arm(requested, principal if pinned is not None else None)
            self._check_available(arm, retry_after_s)
        else:
            arm = self._draw(ctx, retry_after_s, user)
        ctx.outcome.assign_arm(arm.name)
        return arm

    def _draw(self, ctx: RequestContext, retry_after_s: int, user: str | None) -> Arm:
        """The split's draw over every weighted arm (`ctx.arm_drawn`), served by it when it can
        serve, else by a draw with the same point among the arms that can."""
        point = draw_point(user if self.assignment == "user" else None)
        drawn = choose_by_weight(self.primaries, point)
        ctx.outcome.record_draw(None if drawn is None else drawn.name)
        if drawn is not None and drawn.unavailable_reason is None:
            return drawn
        ready = [a for a in self.primaries if a.unavailable_reason is None]
        chosen = choose_by_weight(ready, point)
        if chosen is None:  # nothing ready: report why the first weighted arm is not
            weighted = [a for a in self.primaries if a.weight > 0] or self.primaries
            self._check_available(weighted[0], retry_after_s)
            raise unavailable(f"No arm of `{self.name}` can serve now", retry_after_s)
        return chosen

    def arm(self, name: str, pinned_by: Principal | None = None) -> Arm:
        """The arm called `name` (400 naming the header when there is none); with
        `pinned_by`, a client pin: 403 unless that principal may pin it (`may_pin`)."""
        arm = next((a for a in self.arms if a.name == name), None)
        if pinned_by is not None and arm is not None and not may_pin(arm, pinned_by):
            if arm.shadow:
                arm = None  # NOTE: a shadow arm is not there for clients: not even its name
            else:
                raise APIError(
                    403,
                    f"The arm `{name}` of `{self.name}` takes no traffic of its own; this API "
                    "key may not pin it.",
                    PERMISSION,
                    ARM_HEADER,
                    "arm_not_pinnable",
                )
        if arm is not None:
            return arm
        listed = [a for a in self.arms if pinned_by is None or may_pin(a, pinned_by)]
        known = ", ".join(a.name for a in listed)
        raise invalid(
            f"The model `{self.name}` has no arm named `{shown(name)}`; its arms are: {known}.",
            param=ARM_HEADER,
            code="arm_not_found",
        )

    def _check_available(self, arm: Arm, retry_after_s: int) -> None:
        reason = arm.unavailable_reason
        if reason is not None:
            code = "model_loading" if arm.is_loading else "engine_dead"
            message = f"The model `{self.name}` (arm `{arm.name}`) is not available: {reason}"
            raise unavailable(message, retry_after_s, code)

    @property
    def max_model_len(self) -> int | None:
        return next((a.max_model_len for a in self.arms if a.max_model_len), None)


def may_pin(arm: Arm, principal: Principal) -> bool:
    """Whether a client of `principal` may pin `arm` with `X-Carousel-Arm`: never a shadow;
    a zero-weight arm only when it is `pinnable` or among the principal's `allowed_arms`
    (which, when given, are the only arms the principal may pin)."""
    if arm.shadow:
        return False
    allowed = principal.allowed_arms
    if allowed is not None:
        return arm.name in allowed
    return arm.weight > 0 or arm.pinnable


class Deployments:
    """Every deployment of the app, by served name."""

    def __init__(self, deployments: Iterable[Deployment]) -> None:
        self._by_name = {d.name: d for d in deployments}

    def get(self, name: str) -> Deployment:
        try:
            return self._by_name[name]
        except KeyError:
            raise model_not_found(name) from None

    def __iter__(self) -> Iterator[Deployment]:
        return iter(self._by_name.values())

    def arms(self) -> Iterator[tuple[Deployment, Arm]]:
        for deployment in self:
            for arm in deployment.arms:
                yield deployment, arm

    def unavailable_reason(self) -> tuple[str, bool] | None:
        """(reason, is_loading) of the first primary arm that cannot serve; None when all can.

        NOTE: a shadow arm's state never makes the deployment unready."""
        for deployment, arm in self.arms():
            if arm.shadow:
                continue
            reason = arm.unavailable_reason
            if reason is not None:
                return f"{deployment.name}/{arm.name}: {reason}", arm.is_loading
        return None

    def serving_kernels(self) -> dict[str, str]:
        """Which ops serve each local arm's CPU forward, by `model/arm` (`/health`); arms
        where that does not apply are left out."""
        return {
            f"{d.name}/{a.name}": kernels
            for d, a in self.arms()
            if (kernels := a.serving_kernels) is not None
        }

    def gauges(self) -> list[ArmGauges]:
        return [g for d, a in self.arms() if (g := a.gauges(d.name)) is not None]

    def infos(self) -> list[ArmInfo]:
        return [a.info(d.name) for d, a in self.arms()]
