"""Replica bookkeeping: health, outstanding requests, and least-outstanding choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

import structlog

from backends.upstream.config import display_url

log = structlog.get_logger(__name__)


@dataclass
class ReplicaState:
    """One replica as seen by the client: `url` has credentials and query stripped.

    `failures` counts consecutive failed attempts (requests or health checks) since the
    replica last answered; `outstanding` counts requests in flight on it.
    """

    url: str
    healthy: bool = True
    outstanding: int = 0
    failures: int = 0


class ReplicaPool:
    """Chooses replicas by least outstanding requests among healthy ones, ties round robin.

    Replicas are addressed by index. When no untried replica is healthy, the unhealthy ones
    are tried anyway: health information may be stale.
    """

    def __init__(self, base_urls: tuple[str, ...]) -> None:
        self._states = [ReplicaState(display_url(url)) for url in base_urls]
        self._next = 0  # round-robin cursor for breaking ties

    def __len__(self) -> int:
        return len(self._states)

    def snapshot(self) -> list[ReplicaState]:
        """Copies of the replica states, for metrics and debugging."""
        return [dataclasses.replace(state) for state in self._states]

    def acquire(self, exclude: Collection[int] = ()) -> int:
        """Pick a replica not in `exclude`, count a request on it, return its index."""
        untried = [i for i in range(len(self._states)) if i not in exclude]
        if not untried:
            raise ValueError("every replica was already tried")
        candidates = [i for i in untried if self._states[i].healthy] or untried
        least = min(self._states[i].outstanding for i in candidates)
        tied = [i for i in candidates if self._states[i].outstanding == least]
        choice = min(tied, key=lambda i: (i - self._next) % len(self._states))
        self._next = (choice + 1) % len(self._states)
        self._states[choice].outstanding += 1
        return choice

    def release(self, index: int) -> None:
        """A request on replica `index` finished (successfully or not)."""
        self._states[index].outstanding -= 1

    def mark_up(self, index: int) -> None:
        """Replica `index` answered: healthy again, failure count reset."""
        state = self._states[index]
        if not state.healthy:
            log.info("upstream_replica_up", replica=state.url, after_failures=state.failures)
        state.healthy = True
        state.failures = 0

    def mark_down(self, index: int, reason: str) -> None:
        """Replica `index` failed to answer; take it out of rotation until it recovers."""
        state = self._states[index]
        if state.healthy:
            log.warning("upstream_replica_down", replica=state.url, reason=reason)
        state.healthy = False
        state.failures += 1
