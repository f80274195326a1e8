"""Stored responses (`store: true`), for `previous_response_id`, `GET /v1/responses/{id}` (and
its `input_items`) and `DELETE /v1/responses/{id}`, and which arm answered each response id,
so those reach the arm that holds it. Everything is kept per principal (the API key's owner,
gateway/settings/principals.py): another principal's id is simply not found (404, as OpenAI
answers), and each principal has its own bounded LRU, so one key's traffic evicts only its
own responses.

Each entry keeps the response object as returned and the conversation through it (Responses
items, `responses_convert.conversation_after`), so continuing a response needs one lookup,
not a walk up its chain. Each principal keeps at most `max_responses` entries and about
`max_bytes` of their JSON (or its own `max_stored_bytes`); its least recently used go first.

Beside the stored responses, the store remembers which `(model, arm)` created each response
id it saw for that principal (local or forwarded to an upstream, which keeps its own copy
under the upstream's id), in a second LRU of `max_responses` entries per principal:
`GET`/`DELETE` of an upstream's response and a `previous_response_id` naming one are sent to
that arm, and an id not noted for the principal is never looked for upstream.

Two backends: `MemoryResponseStore` (this process; a restart forgets, each replica has its
own) and `RedisResponseStore` (gateway/api/responses/redis_store.py; replicas share it).
"""

from __future__ import annotations

import abc
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.api.problems import ParamProblem
from gateway.settings.principals import ANONYMOUS_NAME

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 << 20


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


class ResponseStore(abc.ABC):
    """Stored responses and their creating arms, per principal (see the module docstring)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        budgets: Mapping[str, int] | None = None,
    ) -> None:
        if max_responses < 1:
            raise ValueError("max_responses must be at least 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        #: principals' own byte budgets (`max_stored_bytes`); others get `max_bytes`
        self.budgets = dict(budgets or {})

    def budget(self, principal: str) -> int:
        """The bytes of stored responses `principal` may keep."""
        return self.budgets.get(principal, self.max_bytes)

    @abc.abstractmethod
    async def put(
        self,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        num_input_items: int | None = None,
        principal: str = ANONYMOUS_NAME,
    ) -> bool:
        """Store (or replace) `principal`'s response; False when it alone exceeds its budget.
        `num_input_items` defaults to every item not in `response["output"]`."""

    @abc.abstractmethod
    async def get(self, response_id: str, principal: str = ANONYMOUS_NAME) -> StoredResponse | None:
        """`principal`'s stored response (now its most recently used), or None."""

    @abc.abstractmethod
    async def delete(self, response_id: str, principal: str = ANONYMOUS_NAME) -> bool:
        """Forget `principal`'s response; False when it was not stored."""

    @abc.abstractmethod
    async def remember_owner(
        self, response_id: str, model: str, arm: str, principal: str = ANONYMOUS_NAME
    ) -> None:
        """Note that `arm` of `model` created `response_id` for `principal`."""

    @abc.abstractmethod
    async def owner(
        self, response_id: str, principal: str = ANONYMOUS_NAME
    ) -> ResponseOwner | None:
        """Which arm created `response_id` for `principal`, if this gateway noted it."""

    @abc.abstractmethod
    async def forget_owner(self, response_id: str, principal: str = ANONYMOUS_NAME) -> None:
        """Drop the note of who created `response_id` for `principal`."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (the app's shutdown)."""


def entry_of(
    response: dict[str, Any], conversation: list[dict[str, Any]], num_input_items: int | None
) -> dict[str, Any]:
    """The stored form of a response (what both backends keep, as JSON)."""
    if num_input_items is None:
        num_input_items = len(conversation) - len(response.get("output") or [])
    return {"response": response, "conversation": conversation, "num_input_items": num_input_items}


def stored_response(entry: dict[str, Any], size_bytes: int) -> StoredResponse:
    return StoredResponse(
        entry["response"], entry["conversation"], entry["num_input_items"], size_bytes
    )


@dataclass
class _Shelf:
    """One principal's part of the memory store."""

    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    owners: OrderedDict[str, ResponseOwner] = field(default_factory=OrderedDict)
    size_bytes: int = 0

    def remove(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.size_bytes -= entry.size_bytes
        return True


class MemoryResponseStore(ResponseStore):
    """The store in this process: one LRU per principal (the default backend)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        budgets: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(max_responses, max_bytes, budgets)
        self._shelves: dict[str, _Shelf] = {}
        self._lock = threading.Lock()

    def _shelf(self, principal: str) -> _Shelf:
        return self._shelves.setdefault(principal, _Shelf())

    async def put(
        self,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        num_input_items: int | None = None,
        principal: str = ANONYMOUS_NAME,
    ) -> bool:
        entry = entry_of(response, conversation, num_input_items)
        size = len(json.dumps(entry))
        budget = self.budget(principal)
        if size > budget:
            return False
        with self._lock:
            shelf = self._shelf(principal)
            shelf.remove(response_id)
            shelf.entries[response_id] = stored_response(entry, size)
            shelf.size_bytes += size
            while len(shelf.entries) > self.max_responses or shelf.size_bytes > budget:
                shelf.remove(next(iter(shelf.entries)))
        return True

    async def get(self, response_id: str, principal: str = ANONYMOUS_NAME) -> StoredResponse | None:
        with self._lock:
            shelf = self._shelf(principal)
            entry = shelf.entries.get(response_id)
            if entry is not None:
                shelf.entries.move_to_end(response_id)
            return entry

    async def delete(self, response_id: str, principal: str = ANONYMOUS_NAME) -> bool:
        with self._lock:
            return self._shelf(principal).remove(response_id)

    async def remember_owner(
        self, response_id: str, model: str, arm: str, principal: str = ANONYMOUS_NAME
    ) -> None:
        with self._lock:
            owners = self._shelf(principal).owners
            owners.pop(response_id, None)
            owners[response_id] = ResponseOwner(model, arm)
            while len(owners) > self.max_responses:
                owners.popitem(last=False)

    async def owner(
        self, response_id: str, principal: str = ANONYMOUS_NAME
    ) -> ResponseOwner | None:
        with self._lock:
            owners = self._shelf(principal).owners
            owner = owners.get(response_id)
            if owner is not None:
                owners.move_to_end(response_id)
            return owner

    async def forget_owner(self, response_id: str, principal: str = ANONYMOUS_NAME) -> None:
        with self._lock:
            self._shelf(principal).owners.pop(response_id, None)

    def __len__(self) -> int:
        return sum(len(s.entries) for s in self._shelves.values())

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self._shelves.values())


async def previous_conversation(
    store: ResponseStore, previous_response_id: str | None, principal: str = ANONYMOUS_NAME
) -> list[dict[str, Any]] | ParamProblem:
    """The conversation a request continues: [] without `previous_response_id`, a 404 problem
    when `principal` has no such response stored (or no longer)."""
    if previous_response_id is None:
        return []
    entry = await store.get(previous_response_id, principal)
    if entry is None:
        return previous_not_found(previous_response_id)
    return entry.conversation


class ResponseCreator(Protocol):
    """The request that created a response, as the store notes it (a `RequestContext` is
    one; the store needs no more of a request than this)."""

    model: str
    principal: str

    @property
    def arm(self) -> str | None: ...


async def remember_creator(store: ResponseStore, ctx: ResponseCreator, response_id: str) -> None:
    """Note that `ctx`'s arm created `response_id` for `ctx`'s principal: GET, DELETE and
    `previous_response_id` are routed to it, for that principal only (nothing without an arm)."""
    if ctx.arm is not None:
        await store.remember_owner(response_id, ctx.model, ctx.arm, ctx.principal)


def previous_not_found(previous_response_id: str) -> ParamProblem:
    return ParamProblem(
        "previous_response_id",
        f"Previous response with id '{previous_response_id}' not found.",
        "previous_response_not_found",
        status=404,
    )
