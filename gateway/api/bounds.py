"""Bounds on the free-form fields a client attaches to a request (`metadata`, `user`), on
every endpoint that takes them: they are stored with a response and echoed back, so without
a bound one key could fill the response store with a few requests (docs/reliability.md,
"Tenancy and abuse").

`metadata` has OpenAI's limits: at most 16 pairs, keys of at most 64 characters, values of
at most 512. OpenAI documents no length for `user`; Carousel takes 256 characters.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 256


def _limit(message: str) -> PydanticCustomError:
    return PydanticCustomError("limit_exceeded", message)


def _check_metadata(value: Any) -> Any:
    """Refuse an oversized `metadata` before its pairs are validated one by one."""
    if not isinstance(value, dict):
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise _limit(f"at most {MAX_METADATA_PAIRS} metadata pairs are allowed, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _limit(f"metadata keys may be at most {MAX_METADATA_KEY_CHARS} characters long")
        if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
            raise _limit(
                f"metadata values may be at most {MAX_METADATA_VALUE_CHARS} characters long"
            )
    return value


#: `metadata`: string pairs within OpenAI's limits
Metadata = Annotated[dict[str, str], BeforeValidator(_check_metadata)]
#: `user`: an end-user id for sticky arm choice (and `fair`'s principal without API keys)
User = Annotated[str, Field(max_length=MAX_USER_CHARS)]
