"""tests/file_order.py's lists stay true to the suite: the files it names exist, and its
serial files are exactly the files with `serial` tests."""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

from tests.file_order import LONGEST_FILES, SERIAL_FILES, reorder
from tests.parallel import SERIAL, TIMED_FIXTURES

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_file_is_a_test_file_of_the_suite() -> None:
    for name in (*LONGEST_FILES, *SERIAL_FILES):
        assert (ROOT / name).is_file(), name
    assert not set(LONGEST_FILES) & set(SERIAL_FILES)


def test_the_serial_files_are_the_files_with_serial_tests() -> None:
    """A `serial` mark or a timing fixture (which marks its tests `serial`) in the file."""
    serial = re.compile(rf"mark\.{SERIAL}\b|\b({'|'.join(TIMED_FIXTURES)})\b")
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if serial.search(path.read_text())
    }
    assert marked == set(SERIAL_FILES)


def test_long_files_go_first_and_serial_files_last() -> None:
    queue = OrderedDict.fromkeys(["tests/a.py", SERIAL_FILES[0], LONGEST_FILES[1], "tests/b.py",
                                  LONGEST_FILES[0]], {})  # fmt: skip
    reorder(queue)
    assert list(queue) == [LONGEST_FILES[0], LONGEST_FILES[1], "tests/a.py", "tests/b.py",
                           SERIAL_FILES[0]]  # fmt: skip
