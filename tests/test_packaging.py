"""The scripts and the shipped packages import nothing from tests/, which the wheel leaves out."""

from __future__ import annotations

from tests.test_layering import ROOT, imports_of, top

SHIPPED = ("gateway", "schedulers", "backends", "bench")


def test_scripts_and_shipped_packages_import_nothing_from_tests() -> None:
    paths = sorted((ROOT / "scripts").glob("*.py"))
    paths += [p for package in SHIPPED for p in sorted((ROOT / package).rglob("*.py"))]
    bad = [e for path in paths for e in imports_of(path) if top(e.target) == "tests"]
    assert not bad, bad
