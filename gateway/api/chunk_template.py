"""Stream chunks whose only varying field is one string, without a pydantic model per token.

A streamed completion or chat response sends one chunk per token, alike but for the index
and the text. `TextChunks` renders the chunk of each choice index once through its pydantic
model, with a marker for the text, splits it there, and then fills in each token's text with
the json module's C string encoder: the same bytes as the model's `model_dump_json` (which
escapes quotes, backslashes and control characters and writes other characters as UTF-8),
for about a tenth of the cost. A render in which the marker does not appear exactly once
(say, a model named after it) is used as is, every time.
"""

from __future__ import annotations

import json
from collections.abc import Callable

#: renders the chunk of choice `index` with `text`
Render = Callable[[int, str], str]

_MARKER = "carousel-chunk-text-7d1c5e"
_ENCODED_MARKER = json.dumps(_MARKER)
_encode_string = json.JSONEncoder(ensure_ascii=False).encode


class TextChunks:
    """`chunks(index, text)` is `render(index, text)`, from a template per index."""

    def __init__(self, render: Render) -> None:
        self._render = render
        self._templates: dict[int, tuple[str, str] | None] = {}

    def __call__(self, index: int, text: str) -> str:
        try:
            template = self._templates[index]
        except KeyError:
            template = self._templates[index] = self._template(index)
        if template is None:
            return self._render(index, text)
        return template[0] + _encode_string(text) + template[1]

    def _template(self, index: int) -> tuple[str, str] | None:
        rendered = self._render(index, _MARKER)
        if rendered.count(_ENCODED_MARKER) != 1:
            return None
        head, _, tail = rendered.partition(_ENCODED_MARKER)
        return head, tail
