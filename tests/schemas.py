"""JSON schemas the constrained-decoding tests hold outputs of the default model to."""

from __future__ import annotations

from typing import Any

#: a small object with bounded strings, a bounded integer, an enum and an optional array
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
}
