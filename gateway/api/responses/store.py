"""A bounded in-process LRU of stored responses (`store: true`), for `previous_response_id`,
`GET /v1/responses/{id}` (and its `input_items`) and `DELETE /v1/responses/{id}`, and which
arm answered each response id, so those reach the arm that holds it.

Each entry keeps the response object as returned and the conversation through it (Responses
items, `responses_convert.conversation_after`), so continuing a response needs one lookup,
not a walk up its chain. The store holds at most `max_responses` entries and about
`max_bytes` of their JSON; the least recently used go first. It lives in the gateway
process: a restart forgets everything, and each gateway replica has its own.

Beside the stored responses, the store remembers which `(model, arm)` created each response
id it saw (local or forwarded to an upstream, which keeps its own copy under the upstream's
id), in a second LRU of `max_responses` entries: `GET`/`DELETE` of an upstream's response
and a `previous_response_id` naming one are sent to that arm.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.api.problems import ParamProblem


@dataclass(frozen=True)
class ResponseOwner:
    """The served model and the arm that created a response id."""

    model: str
    arm: str

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.arm


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its body and the conversation a follow-up continues."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    #: how many items of `conversation` came before the response's output (its input items)
    num_input_items: int = 0
    size_bytes: int = field(default=0, compare=False)


class ResponseStore:
    """Thread-safe LRU keyed by response id (see the module docstring)."""

    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 << 20) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be at least 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._owners: OrderedDict[str, ResponseOwner] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        num_input_items: int | None = None,
    ) -> bool:
        """Store (or replace) a response; False when it alone exceeds `max_bytes`.
        `num_input_items` defaults to every item not in `response["output"]`."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        if num_input_items is None:
            num_input_items = len(conversation) - len(response.get("output") or [])
        entry = StoredResponse(response, conversation, num_input_items, size)
        with self._lock:
            self._remove(response_id)
            self._entries[response_id] = entry
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._remove(oldest)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        with self._lock:
            return self._remove(response_id)

    def remember_owner(self, response_id: str, model: str, arm: str) -> None:
        """Note that `arm` of `model` created `response_id` (the oldest note goes first)."""
        with self._lock:
            self._owners.pop(response_id, None)
            self._owners[response_id] = ResponseOwner(model, arm)
            while len(self._owners) > self.max_responses:
                self._owners.popitem(last=False)

    def owner(self, response_id: str) -> ResponseOwner | None:
        """Which arm created `response_id`, if this gateway saw it (and still remembers)."""
        with self._lock:
            owner = self._owners.get(response_id)
            if owner is not None:
                self._owners.move_to_end(response_id)
            return owner

    def forget_owner(self, response_id: str) -> None:
        with self._lock:
            self._owners.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size_bytes
        return True


def previous_conversation(
    store: ResponseStore, previous_response_id: str | None
) -> list[dict[str, Any]] | ParamProblem:
    """The conversation a request continues: [] without `previous_response_id`, a 404 problem
    when that response is not (or no longer) stored."""
    if previous_response_id is None:
        return []
    entry = store.get(previous_response_id)
    if entry is None:
        return ParamProblem(
            "previous_response_id",
            f"Previous response with id '{previous_response_id}' not found.",
            "previous_response_not_found",
            status=404,
        )
    return entry.conversation
