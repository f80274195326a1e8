"""The engine's logger: structlog where it is installed, else stdlib `logging` (GPU images).

Both take `log.info("event_name", key=value)`; without structlog the keys follow the event
name as `key=value`.
"""

from __future__ import annotations

import logging
from typing import Any

NAME = "carousel.engine"


class _StdlibLog:
    """The subset of structlog's bound logger the engine uses, over `logging`."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, fields: dict[str, Any], exc_info: bool) -> None:
        text = " ".join([event, *(f"{k}={v}" for k, v in fields.items())])
        self._log.log(level, text, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields, False)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields, False)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields, False)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields, True)


def engine_log(name: str = NAME) -> Any:
    """structlog's logger `name`, or the stdlib stand-in where structlog is not installed."""
    try:
        import structlog
    except ImportError:
        return _StdlibLog(name)
    return structlog.get_logger(name)
