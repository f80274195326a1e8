"""structlog on stderr, JSON lines or text for a terminal (`--log-format`), with stdlib logs
(uvicorn's) rendered the same way."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def json_logs(log_format: str, stream: TextIO) -> bool:
    """Whether `--log-format` means JSON lines on `stream`: `auto` is text on a terminal (a
    person reads it) and JSON elsewhere (a collector parses it), as `docker logs` would."""
    if log_format == "auto":
        return not stream.isatty()
    return log_format == "json"


def configure_logging(level: str = "info", json_logs: bool = True) -> None:
    """Route structlog and stdlib logging through one renderer (JSON by default)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(),  # NOTE: no escape codes in a file or a pipe
            exception_formatter=structlog.dev.plain_traceback,
        )
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # NOTE: never show locals: frames hold prompts and Authorization headers
            _tracebacks if json_logs else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True


_tracebacks = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)


def _identity(_: Any, __: str, event: Any) -> Any:
    return event
