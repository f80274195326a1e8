"""Where a rollout's state lives between looks and across restarts.

`FileRolloutStore` keeps it in one JSON file, replaced atomically (write, then rename), so
a restarted gateway resumes where it stood; `MemoryRolloutStore` keeps it for the process's
life only (no `rollout_state_file`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol


class RolloutStore(Protocol):
    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...


class MemoryRolloutStore:
    """The state for this process's life."""

    def __init__(self) -> None:
        self._state: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        return self._state

    def save(self, state: dict[str, Any]) -> None:
        self._state = json.loads(json.dumps(state))


class FileRolloutStore:
    """The state in one JSON file (written whole, renamed into place)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        return json.loads(self.path.read_text())  # type: ignore[no-any-return]

    def save(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(self.path.suffix + ".tmp")
        partial.write_text(json.dumps(state))
        os.replace(partial, self.path)
