"""A stand-in for the CPU kernels' compile, for tests of what a build reports."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import backends.torch.cpu_kernels as cpu_kernels
from schedulers.load_phase import current_load_phase


def record_compile_phases(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace the kernels' compile by one that builds nothing and records the load phase it
    ran in; the list it appends to."""
    seen: list[Any] = []

    def compile_(build_dir: Path, csrc: Path, name: str) -> ModuleType:
        seen.append(current_load_phase())
        return ModuleType(name)

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)
    return seen
