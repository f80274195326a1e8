"""The `[bench]` extra, checked before a run instead of at report time.

`pip install carousel-serve` without the extra still registers `carousel bench` (the CLI imports
only what the server has), but the verdict needs scipy and the report's pictures matplotlib: a
run would go for minutes and then fail. `missing_modules` finds that out at once.
"""

from __future__ import annotations

import importlib

#: the extra's modules (pyproject.toml, `bench`), by import name
MODULES: tuple[str, ...] = ("matplotlib", "numpy", "scipy", "tqdm")
INSTALL = "pip install 'carousel-serve[bench]'"


def missing_modules() -> list[str]:
    """The extra's modules that do not import here."""
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def missing_message(missing: list[str]) -> str:
    """The one line that says what is missing and how to install it."""
    return f"the bench extra is not installed (no {', '.join(missing)}): {INSTALL}"
