"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, always all four keys.

Raise an `APIError` (or one of its helpers) anywhere in a request; the handlers installed by
`install_error_handlers` turn it, FastAPI's validation errors, Starlette's 404/405 and any
unexpected exception into that body. Nothing ever answers with FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = structlog.get_logger("carousel.gateway")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
PERMISSION = "permission_error"
SERVER_ERROR = "server_error"
#: `code` of the 503s a draining server answers, and of requests it had to cut short
SHUTTING_DOWN = "server_shutting_down"
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error naming `param`."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def unsupported(param: str, detail: str = "") -> APIError:
    """400 for a parameter whose meaning this server does not implement."""
    message = f"'{param}' is not supported by this server{detail}."
    return APIError(400, message, INVALID_REQUEST, param, "unsupported_parameter")


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, "context_length_exceeded")


#: most characters of a client's value echoed in an error or a log line
MAX_ECHOED_CHARS = 256


def shown(value: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """A client's value as errors and logs may echo it: cut to `limit` characters, saying how
    long it was (a 1 MB `model` must not come back whole, nor fill the access log)."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{shown(model)}` does not exist or you do not have access to it.",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """404 invalid_request_error naming `param` (an unknown stored object)."""
    return APIError(404, message, INVALID_REQUEST, param, code)


def unavailable(message: str, retry_after_s: int, code: str = "service_unavailable") -> APIError:
    """503 with Retry-After: the model is still loading or its engine has stopped."""
    return APIError(503, message, SERVER_ERROR, None, code, {"Retry-After": str(retry_after_s)})


def overloaded(message: str, retry_after_s: int, code: str = "rate_limit_exceeded") -> APIError:
    """429 with Retry-After: too many requests are already waiting (or one waited too long)."""
    return APIError(429, message, RATE_LIMIT, None, code, {"Retry-After": str(retry_after_s)})


def shutting_down(retry_after_s: int) -> APIError:
    """503 with Retry-After: the server is draining before it exits."""
    return unavailable(
        "The server is shutting down and takes no new requests. Please retry shortly.",
        retry_after_s,
        SHUTTING_DOWN,
    )


def server_error(
    message: str = "The server had an error while processing your request.",
) -> APIError:
    return APIError(500, message, SERVER_ERROR, None, None)


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as a param path: ('messages', 0, 'content') ->
    'messages[0].content'. Union member tags ('str', 'list[int]') are dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _TYPE_TAGS or not part.isidentifier():
            continue
        else:
            param += f".{part}" if param else part
    return param or None


def from_validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """400 for the first pydantic error, naming its field."""
    if not errors:
        return invalid("The request body is invalid.")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = param_from_loc(loc)
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param)
    if first.get("type") == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param)
    return invalid(f"Invalid value for '{param}': {message}.", param)


# -- handlers -----------------------------------------------------------------------------


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return from_validation_error(list(exc.errors())).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
        code: str | None = "unknown_url"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    headers = dict(exc.headers or {})
    return APIError(exc.status_code, message, kind, None, code, headers).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error(
        "unhandled_exception",
        path=request.url.path,
        request_id=getattr(request.state, "request_id", None),
        error=repr(exc),
    )  # NOTE: no exc_info: the server re-raises it and uvicorn logs the traceback once
    return server_error().response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
