"""docs/benchmarks.md stays one screen of reproducible figures; its log lives on in history/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
HISTORY = ROOT / "docs" / "benchmarks" / "history"
#: the commit whose docs/benchmarks.md was the whole log, before it moved to history/
LOG_COMMIT = "20d67e9"
#: the path rewrites the move made, old -> new
REWRITES = [
    ("/root/.cache/carousel", "~/.cache/carousel"),
    ("/tmp/k/", "bench-results/"),
    ("/tmp/exp/", "bench-results/"),
    ("](bench/", "](../../bench/"),
]
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(work|root|home|tmp)/")
COMMAND = re.compile(r"`(\.venv/bin/python scripts/[\w-]+\.py|carousel \w+)([^`]*)`")


def figure_rows() -> list[list[str]]:
    """The cells of every row of the page's figure table (the one with a `command` column)."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| figure |"))
    assert "command" in lines[start], "the figure table has no command column"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_the_page_fits_one_screen() -> None:
    assert len(PAGE.read_text().splitlines()) <= 150


def test_every_figure_row_has_a_runnable_command() -> None:
    rows = figure_rows()
    assert rows
    for cells in rows:
        commands = COMMAND.findall(cells[-1])
        assert commands, f"no command for {cells[0]!r}"
        for program, args in commands:
            if not program.startswith(".venv/"):
                continue
            script = ROOT / program.split()[-1]
            assert script.exists(), script
            source = script.read_text()
            for flag in re.findall(r"--[a-z][\w-]*", args):
                assert f'"{flag}"' in source, f"{script.name} has no {flag}"


def test_no_machine_paths_in_the_page_or_its_history() -> None:
    for path in [PAGE, *sorted(HISTORY.glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not MACHINE_PATH.search(line), f"{path.name}:{number}: {line}"


def test_the_history_keeps_every_line_of_the_old_log() -> None:
    shown = subprocess.run(
        ["git", "show", f"{LOG_COMMIT}:docs/benchmarks.md"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if shown.returncode != 0:
        pytest.skip(f"{LOG_COMMIT} is not in this clone's history")
    kept = {line for path in HISTORY.glob("*.md") for line in path.read_text().splitlines()}
    missing = []
    for line in shown.stdout.splitlines():
        for old, new in REWRITES:
            line = line.replace(old, new)
        if line.strip() and line not in kept:
            missing.append(line)
    assert not missing, f"{len(missing)} lines of the old log are missing, first: {missing[0]}"
