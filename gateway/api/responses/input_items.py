"""`GET /v1/responses/{id}/input_items`: a stored response's input items, as OpenAI lists them.

The input items of a response are the conversation it answered (everything a
`previous_response_id` chain carried to it, then its own `input`; not `instructions`, which
are not items), in OpenAI's item shapes: a message's content is a list of `input_text` parts
(`output_text` for an assistant's), each item has an `id` and a `status`. The page is
OpenAI's cursor list: `{"object": "list", "data", "first_id", "last_id", "has_more"}`, with
`limit` (1..100, default 20), `order` (`asc` or `desc`, the default) and `after` (an item id
of the list: the page starts after it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.api.problems import ParamProblem
from gateway.api.responses.store import StoredResponse

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def input_items_page(
    entry: StoredResponse,
    limit: int = DEFAULT_LIMIT,
    order: str = "desc",
    after: str | None = None,
) -> dict[str, Any] | ParamProblem:
    """One page of `entry`'s input items (see the module docstring)."""
    if not 1 <= limit <= MAX_LIMIT:
        return ParamProblem("limit", f"'limit' must be between 1 and {MAX_LIMIT}; got {limit}.")
    if order not in ("asc", "desc"):
        return ParamProblem("order", f"'order' must be 'asc' or 'desc'; got {order!r}.")
    items = [as_item(item) for item in entry.conversation[: entry.num_input_items]]
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            return ParamProblem(
                "after", f"No input item with id '{after}' in this response.", status=404
            )
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }


def as_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """A stored conversation item in the shape OpenAI lists it."""
    kind = item.get("type", "message")
    out = {"type": kind, **item, "status": item.get("status") or "completed"}
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            extra: dict[str, Any] = {"annotations": []} if part == "output_text" else {}
            out["content"] = [{"type": part, "text": content, **extra}]
    return out
