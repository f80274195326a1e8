"""The layers' imports point one way (docs/architecture.md, "Layers").

- `schedulers` never imports `backends` (the engine owns the Backend interface it calls).
- `gateway` never imports torch, except lazily inside the one function that loads a torch
  backend.
- `bench` is a leaf client: it imports none of the server packages, and none of them
  imports it (the CLI finds it by name, with importlib, when it is installed).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("gateway", "schedulers", "backends")
#: (file, function) pairs allowed to import torch lazily from inside the gateway
LAZY_TORCH_LOADS = {("gateway/arms/engine_factory.py", "_torch_modules")}


@dataclass(frozen=True)
class Edge:
    """`source` (a file, relative to the repo) imports `target` (a dotted module)."""

    source: str
    target: str
    function: str | None  # the enclosing function, None at module level
    line: int


def imports_of(path: Path, root: Path = ROOT) -> list[Edge]:
    """Every import in `path`, with the function it sits in (None at module level)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    source = str(path.relative_to(root))
    edges: list[Edge] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, function or child.name)
                continue
            if isinstance(child, ast.Import):
                edges.extend(Edge(source, a.name, function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                edges.append(Edge(source, child.module, function, child.lineno))
            visit(child, function)

    visit(tree, None)
    return edges


def package_edges(package: str) -> list[Edge]:
    return [e for path in sorted((ROOT / package).rglob("*.py")) for e in imports_of(path)]


def top(module: str) -> str:
    return module.split(".")[0]


def test_schedulers_never_import_backends() -> None:
    bad = [e for e in package_edges("schedulers") if top(e.target) == "backends"]
    assert not bad, bad


def test_gateway_imports_torch_only_in_the_lazy_backend_load() -> None:
    bad = [
        e
        for e in package_edges("gateway")
        if (top(e.target) == "torch" or e.target.startswith("backends.torch"))
        and (e.source, e.function) not in LAZY_TORCH_LOADS
    ]
    assert not bad, bad


def test_bench_imports_no_server_package() -> None:
    bad = [e for e in package_edges("bench") if top(e.target) in SERVER]
    assert not bad, bad


def test_no_server_package_imports_bench() -> None:
    bad = [e for p in SERVER for e in package_edges(p) if top(e.target) == "bench"]
    assert not bad, bad


def test_the_edge_finder_sees_lazy_and_module_level_imports(tmp_path: Path) -> None:
    """The walker itself: a module-level and a function-level import are both found."""
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef f() -> None:\n    from torch import nn\n")
    edges = imports_of(sample, tmp_path)
    assert [(e.target, e.function) for e in edges] == [("os", None), ("torch", "f")]


def test_importing_the_gateway_app_does_not_import_torch() -> None:
    code = "import sys, gateway.app, gateway.cli; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert result.returncode == 0, result.stderr.decode() or "gateway.app imported torch"
