"""A request problem as a value: what is wrong and which `param` it is about.

The request-shaping helpers (tool_calls, response_format, responses_convert) return these
instead of raising, so they stay pure; the serving code turns one into an OpenAI-shaped error
(`errors.invalid(problem.message, problem.param, problem.code)`, or a 404 when `status` says so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamProblem:
    """Why a request cannot be served: HTTP `status`, the `param` it names, and a message."""

    param: str | None
    message: str
    code: str | None = None
    status: int = 400
