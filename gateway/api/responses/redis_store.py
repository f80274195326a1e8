"""The response store on Redis (`--response-store redis://host:port/db`): gateway replicas
behind one load balancer continue each other's conversations.

The same rules as the memory store (gateway/api/responses/store.py): everything is kept
under its principal's own keys, so another principal's id is not found, and each principal's
LRU is bounded by its own count and byte budget. Per principal and kind (`resp`, `owner`):

    <prefix><principal>:<kind>:items   hash: response id -> JSON
    <prefix><principal>:<kind>:lru     sorted set: response id -> last use (a counter)
    <prefix><principal>:<kind>:bytes   the JSON bytes the hash holds
    <prefix><principal>:<kind>:clock   the counter (one per LRU, so replicas' clocks never
                                       disagree)

Each operation is one Lua script, so a put and the evictions it causes are atomic across
replicas. A Redis that cannot be reached is a 503 for lookups; a response that cannot be
stored is logged and still delivered.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.api.errors import APIError, unavailable
from gateway.api.responses.store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RESPONSES,
    ResponseOwner,
    ResponseStore,
    StoredResponse,
    entry_of,
    stored_response,
)
from gateway.settings.principals import ANONYMOUS_NAME

log = structlog.get_logger("carousel.gateway")
KEY_PREFIX = "carousel:"
#: no byte bound (the owner notes are bounded by count only)
_UNBOUNDED = 1 << 62

# KEYS: items, lru, bytes, clock. ARGV: id, value, max_bytes, max_count. 0 if too big.
_PUT = """
local size = string.len(ARGV[2])
local max_bytes, max_count = tonumber(ARGV[3]), tonumber(ARGV[4])
if size > max_bytes then return 0 end
local old = redis.call('HSTRLEN', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
local total = redis.call('INCRBY', KEYS[3], size - old)
while total > max_bytes or redis.call('ZCARD', KEYS[2]) > max_count do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  total = redis.call('INCRBY', KEYS[3], -redis.call('HSTRLEN', KEYS[1], oldest))
  redis.call('HDEL', KEYS[1], oldest)
  redis.call('ZREM', KEYS[2], oldest)
end
return 1
"""
# KEYS: items, lru, bytes, clock. ARGV: id. The value (now the most recently used), or nil.
_GET = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1]) end
return value
"""
# KEYS: items, lru, bytes, clock. ARGV: id. 1 if it was there.
_DELETE = """
local size = redis.call('HSTRLEN', KEYS[1], ARGV[1])
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if removed > 0 then redis.call('DECRBY', KEYS[3], size) end
return removed
"""


class RedisResponseStore(ResponseStore):
    """Stored responses and owner notes in Redis, per principal (see the module docstring)."""

    def __init__(
        self,
        url: str,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        budgets: dict[str, int] | None = None,
        prefix: str = KEY_PREFIX,
        retry_after_s: int = 1,
    ) -> None:
        super().__init__(max_responses, max_bytes, budgets)
        self.prefix = prefix
        self.retry_after_s = retry_after_s
        self._client = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self._put = self._client.register_script(_PUT)
        self._get = self._client.register_script(_GET)
        self._delete = self._client.register_script(_DELETE)

    def _keys(self, principal: str, kind: str) -> list[str]:
        base = f"{self.prefix}{principal}:{kind}:"
        return [base + part for part in ("items", "lru", "bytes", "clock")]

    def _unavailable(self, exc: RedisError) -> APIError:
        log.warning("response_store_unavailable", error=type(exc).__name__)
        return unavailable(
            "The response store is not available now.", self.retry_after_s, "store_unavailable"
        )

    async def _lookup(self, principal: str, kind: str, response_id: str) -> bytes | None:
        try:
            value = await self._get(keys=self._keys(principal, kind), args=[response_id])
        except RedisError as exc:
            raise self._unavailable(exc) from None
        return value if isinstance(value, bytes) else None

    async def _remove(self, principal: str, kind: str, response_id: str) -> bool:
        try:
            removed = await self._delete(keys=self._keys(principal, kind), args=[response_id])
        except RedisError as exc:
            raise self._unavailable(exc) from None
        return bool(removed)

    async def put(
        self,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        num_input_items: int | None = None,
        principal: str = ANONYMOUS_NAME,
    ) -> bool:
        value = json.dumps(entry_of(response, conversation, num_input_items))
        args: list[str | int] = [response_id, value, self.budget(principal), self.max_responses]
        try:
            return bool(await self._put(keys=self._keys(principal, "resp"), args=args))
        except RedisError as exc:
            log.warning("response_not_stored", response_id=response_id, error=type(exc).__name__)
            return False

    async def get(self, response_id: str, principal: str = ANONYMOUS_NAME) -> StoredResponse | None:
        value = await self._lookup(principal, "resp", response_id)
        return None if value is None else stored_response(json.loads(value), len(value))

    async def delete(self, response_id: str, principal: str = ANONYMOUS_NAME) -> bool:
        return await self._remove(principal, "resp", response_id)

    async def remember_owner(
        self, response_id: str, model: str, arm: str, principal: str = ANONYMOUS_NAME
    ) -> None:
        value = json.dumps({"model": model, "arm": arm})
        args: list[str | int] = [response_id, value, _UNBOUNDED, self.max_responses]
        try:
            await self._put(keys=self._keys(principal, "owner"), args=args)
        except RedisError as exc:
            log.warning("response_owner_not_noted", error=type(exc).__name__)

    async def owner(
        self, response_id: str, principal: str = ANONYMOUS_NAME
    ) -> ResponseOwner | None:
        value = await self._lookup(principal, "owner", response_id)
        if value is None:
            return None
        note = json.loads(value)
        return ResponseOwner(note["model"], note["arm"])

    async def forget_owner(self, response_id: str, principal: str = ANONYMOUS_NAME) -> None:
        await self._remove(principal, "owner", response_id)

    async def close(self) -> None:
        await self._client.aclose()
