"""OpenAI-shaped errors raised by the upstream client, and the mapping from upstream replies."""

from __future__ import annotations

import json
from typing import Any

#: OpenAI error codes this module produces itself.
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_BAD_RESPONSE = "upstream_bad_response"
UPSTREAM_AUTH_FAILED = "upstream_auth_failed"

_MAX_MESSAGE_CHARS = 1000
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class UpstreamError(Exception):
    """An error to hand to the client as ``{"error": {message, type, param, code}}``.

    `status` is the HTTP status the gateway should answer with (or, mid-stream, the one it
    would have used). Messages never carry tracebacks, API keys or replica URLs.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "server_error",  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body; all four keys are always present."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_sse(self) -> bytes:
        """The in-band SSE event that reports this error after a stream has started."""
        return b"data: " + json.dumps(self.to_dict()).encode() + b"\n\n"

    def __repr__(self) -> str:
        return f"UpstreamError({self.status}, {self.code!r}, {self.message!r})"


def unavailable(status: int, message: str) -> UpstreamError:
    """No replica could serve the request (503: unreachable, 502: replicas answered 5xx)."""
    return UpstreamError(status, message, code=UPSTREAM_UNAVAILABLE)


def timeout(message: str) -> UpstreamError:
    """The upstream stopped answering within the configured timeout."""
    return UpstreamError(504, message, code=UPSTREAM_TIMEOUT)


def bad_response(message: str) -> UpstreamError:
    """The upstream answered with something that is not a valid OpenAI response."""
    return UpstreamError(502, message, code=UPSTREAM_BAD_RESPONSE)


def error_from_client_error(status: int, content: bytes) -> UpstreamError:
    """Map an upstream 4xx reply to the error the client should see.

    OpenAI-shaped bodies pass through field by field; flat bodies (vLLM's
    ``{"error": "Unauthorized"}``, TGI/SGLang ``{"message": ...}``, FastAPI ``{"detail":
    ...}``) are wrapped. 401/403 mean the upstream rejected *the gateway's* key, not the
    client's, so they become a 502 ``upstream_auth_failed`` rather than an auth error the
    client would misread as its own.
    """
    if status in (401, 403):
        return UpstreamError(
            502,
            f"the upstream rejected the gateway's credentials (HTTP {status})",
            code=UPSTREAM_AUTH_FAILED,
        )
    default_type = _TYPE_BY_STATUS.get(status, "invalid_request_error")
    body = _json_or_none(content)
    if not isinstance(body, dict):
        return UpstreamError(status, f"upstream returned HTTP {status}", type=default_type)
    fields = body["error"] if isinstance(body.get("error"), dict) else body
    message = _message_of(fields) or f"upstream returned HTTP {status}"
    err_type = fields.get("type") or fields.get("error_type")
    return UpstreamError(
        status,
        message,
        type=err_type if isinstance(err_type, str) and err_type else default_type,
        param=_str_or_none(fields.get("param")),
        code=_str_or_none(fields.get("code")),
    )


def _message_of(fields: dict[str, Any]) -> str | None:
    for key in ("message", "error"):
        if isinstance(fields.get(key), str):
            return clean_message(fields[key])
    detail = fields.get("detail")
    if isinstance(detail, str):
        return clean_message(detail)
    if isinstance(detail, list):
        parts = [_describe_detail(item) for item in detail]
        return clean_message("; ".join(part for part in parts if part))
    return None


def _describe_detail(item: object) -> str:
    if not isinstance(item, dict):
        return str(item)
    loc = item.get("loc")
    where = ".".join(str(p) for p in loc if p != "body") if isinstance(loc, list) else ""
    msg = str(item.get("msg", ""))
    return f"{where}: {msg}" if where else msg


def clean_message(message: str) -> str:
    """Cut a message at any embedded Python traceback and bound its length."""
    cut = message.find("Traceback (most recent call last)")
    if cut >= 0:
        message = message[:cut].rstrip() or "upstream internal error"
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return message


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
