"""Setting errors as a person reads them: one line per problem, secrets never shown.

pydantic's own rendering of a `ValidationError` spans three lines per problem, ends each with
a web address, and repeats the value it refused: an API key, an upstream's `api_key`, a
password inside a URL. `problem_lines` gives one line per problem (`where: what (got X)`),
the value only where it is a short scalar, and through `redact`, so nothing secret reaches a
terminal or a log. `redact` and `redact_url` are the one place that decides what is secret;
whatever prints a setting's value (errors, start-up logs) goes through them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

REDACTED = "<redacted>"
#: a setting whose name holds one of these words is secret, whatever its value
SECRET_WORDS = ("api_key", "api_keys", "password", "passwd", "secret", "token", "authorization")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_SHOWN_CHARS = 80


def is_secret_name(name: str) -> bool:
    """Whether a setting (or a loc part) called `name` holds a secret."""
    lowered = name.lower().replace("-", "_")
    return any(word in lowered for word in SECRET_WORDS)


def redact_url(url: str) -> str:
    """`url` with the password of its user info replaced (`http://u:<redacted>@host/`)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    netloc = f"{parts.username or ''}:{REDACTED}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def redact(text: str) -> str:
    """`text` with every URL's password replaced (API keys are redacted by name: `value_for`)."""
    return _URL.sub(lambda match: redact_url(match.group(0)), text)


def value_for(loc: Iterable[Any], value: Any) -> Any:
    """`value` as it may be shown for the setting at `loc`: `REDACTED` for a secret one,
    URLs without their passwords, containers recursively."""
    if any(isinstance(part, str) and is_secret_name(part) for part in loc):
        return REDACTED
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: value_for([*loc, str(k)], v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [value_for(loc, v) for v in value]
    return value


def _where(loc: tuple[Any, ...]) -> str:
    """`arms[0].upstream.api_key` from pydantic's ('arms', 0, 'upstream', 'api_key')."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + str(part)
    return text or "settings"


def _shown(loc: tuple[Any, ...], value: Any) -> str | None:
    """The refused value as ` (got X)` text, or None for containers and long values."""
    if not isinstance(value, str | int | float | bool) or value is None:
        return None
    shown = value_for(loc, value)
    text = repr(shown) if isinstance(shown, str) and shown != REDACTED else str(shown)
    return None if len(text) > _SHOWN_CHARS else text


def problem_lines(exc: ValidationError) -> list[str]:
    """One line per problem of `exc`: where, what, and (for a short scalar) the value given."""
    lines = []
    for error in exc.errors(include_url=False, include_context=False):
        loc = tuple(error.get("loc", ()))
        message = redact(str(error.get("msg", "invalid")).removeprefix("Value error, "))
        got = _shown(loc, error.get("input"))
        suffix = f" (got {got})" if got is not None and error.get("type") != "value_error" else ""
        lines.append(f"{_where(loc)}: {message}{suffix}")
    return lines
