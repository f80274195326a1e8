"""Where a rollout's state lives: in memory, in a JSON file, or in Redis shared by replicas.

Two kinds of data, written differently:
- the state (step, status, epoch, carried guardrail evidence, decision log): written whole
  by whoever acts (the replica holding the lease, or an operator's command), as a
  compare-and-set on its `version`: `save(state, expected)` writes only if the stored version
  is still `expected` (0: nothing stored yet), and the written state carries `expected + 1`.
  So an operator's abort on one replica and the decider's advance on another can never
  overwrite each other: the later writer is refused, reads the state back, and decides again
  from it;
- each epoch's tally (gateway/rollout/evidence.py): every replica *adds* its own samples'
  increments; sums are order-free, so increments from any replica in any order add up.

`lease(owner, ttl_s)`: one decider at a time. The holder renews it at every sync; when it dies
the lease expires and another replica's next sync takes it over, reading the same state and
tally, so no step is skipped or repeated. `lease_holder()`: whose it is now (None: nobody's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import redis

from gateway.rollout.evidence import Tally


class RolloutStore(Protocol):
    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any], expected: int) -> bool: ...

    def add_tally(self, epoch: int, tally: Tally) -> None: ...

    def tally(self, epoch: int) -> Tally: ...

    def lease(self, owner: str, ttl_s: float) -> bool: ...

    def lease_holder(self) -> str | None: ...


class MemoryRolloutStore:
    """The state for this process's life (one replica, the lease always its own)."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None
        self._tallies: dict[int, Tally] = {}
        self._holder: str | None = None

    def load(self) -> dict[str, Any] | None:
        return None if self._state is None else json.loads(json.dumps(self._state))

    def save(self, state: dict[str, Any], expected: int) -> bool:
        current = 0 if self._state is None else self._state.get("version", 0)
        if current != expected:
            return False
        self._state = json.loads(json.dumps(state)) | {"version": expected + 1}
        return True

    def add_tally(self, epoch: int, tally: Tally) -> None:
        self._tallies.setdefault(epoch, Tally()).merge(tally)

    def tally(self, epoch: int) -> Tally:
        merged = Tally()
        merged.merge(self._tallies.get(epoch, Tally()))
        return merged

    def lease(self, owner: str, ttl_s: float) -> bool:
        self._holder = owner
        return True

    def lease_holder(self) -> str | None:
        return self._holder


class FileRolloutStore(MemoryRolloutStore):
    """One replica's state and current tally in a JSON file (written whole, renamed into
    place), so a restarted gateway resumes; the file is written at every sync."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        if self.path.exists():
            data = json.loads(self.path.read_text())
            self._state = data["state"]
            self._tallies = {int(k): Tally.from_json(v) for k, v in data["tallies"].items()}

    def save(self, state: dict[str, Any], expected: int) -> bool:
        if not super().save(state, expected):
            return False
        self._write()
        return True

    def add_tally(self, epoch: int, tally: Tally) -> None:
        super().add_tally(epoch, tally)
        self._tallies = {epoch: self._tallies[epoch]}  # only the current epoch matters
        self._write()

    def _write(self) -> None:
        data = {"state": self._state, "tallies": {k: t.to_json() for k, t in self._tallies.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(self.path.suffix + ".tmp")
        partial.write_text(json.dumps(data))
        os.replace(partial, self.path)


class RedisRolloutStore:
    """State, tallies and lease under `prefix` in Redis, shared by every replica."""

    def __init__(self, url: str, prefix: str) -> None:
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.prefix = prefix

    def load(self) -> dict[str, Any] | None:
        raw = self.redis.get(f"{self.prefix}:state")
        return None if raw is None else json.loads(str(raw))

    def save(self, state: dict[str, Any], expected: int) -> bool:
        # NOTE: compare-and-set in one step on the server: read the stored version, write only
        # if it is still `expected`
        written = self.redis.eval(
            "local raw = redis.call('get', KEYS[1]) "
            "local current = 0 "
            "if raw then current = cjson.decode(raw)['version'] or 0 end "
            "if current ~= tonumber(ARGV[2]) then return 0 end "
            "redis.call('set', KEYS[1], ARGV[1]) return 1",
            1,
            f"{self.prefix}:state",
            json.dumps(state | {"version": expected + 1}),
            expected,
        )
        return bool(written)

    def add_tally(self, epoch: int, tally: Tally) -> None:
        key = f"{self.prefix}:tally:{epoch}"
        pipe = self.redis.pipeline(transaction=True)
        for name, wealth in tally.log_wealth.items():
            for j, value in enumerate(wealth):
                pipe.hincrbyfloat(key, f"w:{name}:{j}", value)
            pipe.hincrby(key, f"n:{name}", tally.n.get(name, 0))
        for prefix, counts in (("req", tally.requests), ("unit", tally.units),
                               ("apart", tally.apart)):  # fmt: skip
            for arm, count in counts.items():
                pipe.hincrby(key, f"{prefix}:{arm}", count)
        pipe.execute()

    def tally(self, epoch: int) -> Tally:
        fields: dict[str, str] = self.redis.hgetall(f"{self.prefix}:tally:{epoch}")  # type: ignore[assignment]
        tally = Tally()
        for field, value in fields.items():
            kind, _, rest = field.partition(":")
            if kind in ("req", "unit", "apart"):
                counts = {"req": tally.requests, "unit": tally.units, "apart": tally.apart}[kind]
                counts[rest] = int(value)
            elif kind == "n":
                tally.n[rest] = int(value)
            else:
                name, _, j = rest.rpartition(":")
                wealth = tally.log_wealth.setdefault(name, [])
                wealth.extend([0.0] * (int(j) + 1 - len(wealth)))
                wealth[int(j)] = float(value)
        return tally

    def lease(self, owner: str, ttl_s: float) -> bool:
        key, ttl_ms = f"{self.prefix}:lease", max(1, int(ttl_s * 1000))
        if self.redis.set(key, owner, nx=True, px=ttl_ms):
            return True
        # NOTE: compare-and-renew in one step, so an expired lease is never renewed by its
        # old holder after another replica took it
        renewed = self.redis.eval(
            "if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end",
            1,
            key,
            owner,
            ttl_ms,
        )
        return bool(renewed)

    def lease_holder(self) -> str | None:
        holder = self.redis.get(f"{self.prefix}:lease")
        return None if holder is None else str(holder)


def open_store(where: str | None, model: str) -> RolloutStore:
    """`--rollout-store`: a redis:// URL (shared by replicas), a file path, or None (memory)."""
    if where is None:
        return MemoryRolloutStore()
    if where.startswith(("redis://", "rediss://", "unix://")):
        return RedisRolloutStore(where, f"carousel:rollout:{model}")
    return FileRolloutStore(where)
