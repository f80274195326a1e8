"""The layers' imports point one way (docs/architecture.md, "Layers").

- `schedulers` never imports `backends` (the engine owns the Backend interface it calls).
- `gateway` never imports torch, except lazily inside the one function that loads a torch
  backend.
- `bench` is a leaf client: it imports none of the server packages, and none of them
  imports it (the CLI finds it by name, with importlib, when it is installed).
- `schedulers` and `backends` never import `gateway`.
- Inside the gateway, the rooms point one way: `gateway.api` never imports `gateway.arms` or
  `gateway.http`; `gateway.settings` and `gateway.obs` import no other gateway module.
- `gateway.rollout` (the rollout's tests and controller) imports no gateway room but
  `gateway.settings`: the decision core stays a pure function the simulator can run.
- The gateway imports at module level, except the one lazy torch load.
- No module of the project is in an import cycle (function-level and TYPE_CHECKING imports
  count: a cycle hidden behind one still couples the modules).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("gateway", "schedulers", "backends")
PROJECT = (*SERVER, "bench")
#: (file, function) pairs allowed to import torch lazily from inside the gateway
LAZY_TORCH_LOADS = {("gateway/arms/engine_factory.py", "_torch_modules")}
#: torch backend modules that import no torch, which the gateway may ask at module level:
#: the config, which owns which settings the backend honours
TORCH_FREE = {"backends.torch.config"}


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
        and e.target not in TORCH_FREE
        and (e.source, e.function) not in LAZY_TORCH_LOADS
    ]
    assert not bad, bad


def test_gateway_imports_at_module_level_except_the_lazy_torch_load() -> None:
    """A function-level import would hide an import cycle, not remove it."""
    bad = [
        e
        for e in package_edges("gateway")
        if e.function is not None and (e.source, e.function) not in LAZY_TORCH_LOADS
    ]
    assert not bad, bad


def test_bench_imports_no_server_package() -> None:
    bad = [e for e in package_edges("bench") if top(e.target) in SERVER]
    assert not bad, bad


def test_no_server_package_imports_bench() -> None:
    bad = [e for p in SERVER for e in package_edges(p) if top(e.target) == "bench"]
    assert not bad, bad


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_schedulers_and_backends_never_import_gateway() -> None:
    bad = [
        e
        for p in ("schedulers", "backends")
        for e in package_edges(p)
        if top(e.target) == "gateway"
    ]
    assert not bad, bad


def test_the_api_never_imports_the_arms_or_http() -> None:
    edges = [e for path in sorted((ROOT / "gateway/api").rglob("*.py")) for e in imports_of(path)]
    bad = [
        e for e in edges if in_room(e.target, "gateway.arms") or in_room(e.target, "gateway.http")
    ]
    assert not bad, bad


@pytest.mark.parametrize("room", ["gateway.settings", "gateway.obs"])
def test_settings_and_obs_import_no_other_gateway_module(room: str) -> None:
    folder = ROOT / room.replace(".", "/")
    edges = [e for path in sorted(folder.rglob("*.py")) for e in imports_of(path)]
    bad = [e for e in edges if top(e.target) == "gateway" and not in_room(e.target, room)]
    assert not bad, bad


def test_the_rollout_imports_only_the_settings() -> None:
    edges = [
        e for path in sorted((ROOT / "gateway/rollout").rglob("*.py")) for e in imports_of(path)
    ]
    bad = [
        e
        for e in edges
        if top(e.target) == "gateway"
        and not (in_room(e.target, "gateway.rollout") or in_room(e.target, "gateway.settings"))
    ]
    assert not bad, bad


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(packages: tuple[str, ...], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in it (`from pkg import name`
    where `name` is a submodule is an edge to the submodule)."""
    files = {module_name(f, root): f for p in packages for f in sorted((root / p).rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name not in files:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            targets = {resolve(n) for n in names}
            graph[module] |= {t for t in targets if t is not None and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_project_module_is_in_an_import_cycle() -> None:
    cycles = import_cycles(module_graph(PROJECT))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle_through_a_submodule_and_a_lazy_import(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f() -> None:\n    import pkg.c\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = module_graph(("pkg",), tmp_path)
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_edge_finder_sees_lazy_and_module_level_imports(tmp_path: Path) -> None:
    """The walker itself: a module-level and a function-level import are both found."""
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef f() -> None:\n    from torch import nn\n")
    edges = imports_of(sample, tmp_path)
    assert [(e.target, e.function) for e in edges] == [("os", None), ("torch", "f")]


@pytest.mark.parametrize("module", sorted(TORCH_FREE))
def test_the_torch_free_modules_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert result.returncode == 0, result.stderr.decode() or f"{module} imported torch"


def test_importing_the_gateway_app_does_not_import_torch() -> None:
    code = "import sys, gateway.app, gateway.cli; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert result.returncode == 0, result.stderr.decode() or "gateway.app imported torch"


TORCH = "backends/torch"


def room_edges(room: str) -> list[Edge]:
    """Every import in the torch backend's room `room` (a folder or a module)."""
    path = ROOT / TORCH / room
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return [e for f in files for e in imports_of(f)]


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        ("layers", ("stacks", "quantization", "models")),
        ("models", ("stacks",)),
    ],
)
def test_the_torch_rooms_point_one_way(room: str, forbidden: tuple[str, ...]) -> None:
    """The layers know no model, stack or quantisation; the family files know no stack."""
    banned = [f"backends.torch.{name}" for name in forbidden]
    bad = [e for e in room_edges(room) if any(in_room(e.target, b) for b in banned)]
    assert not bad, bad


#: the HF attribute names of the Llama family's modules (a family file's vocabulary), read as
#: attributes (`.q_proj`) or named in strings (`"q_norm"`, `r"q_proj\."`); a local variable
#: named `q_norm` is not an HF name
HF_NAMES = re.compile(
    r"[.'\"](q_proj|k_proj|v_proj|gate_proj|up_proj|down_proj|self_attn|q_norm|k_norm|"
    r"input_layernorm|post_attention_layernorm|embed_tokens|rotary_emb|variance_epsilon)\b"
)


def hf_name_lines(root: Path) -> list[str]:
    """`file:line` of every use of a HF attribute name in the server's code outside
    backends/torch/models/."""
    found = []
    for package in SERVER:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if relative.parts[:3] == ("backends", "torch", "models"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if HF_NAMES.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_hf_attribute_names_appear_in_the_family_files_only() -> None:
    found = hf_name_lines(ROOT)
    assert not found, "HF names outside backends/torch/models/:\n" + "\n".join(found)


def test_the_name_finder_finds_a_hf_name_outside_models(tmp_path: Path) -> None:
    (tmp_path / "backends/torch/models").mkdir(parents=True)
    (tmp_path / "backends/torch/models/llama.py").write_text("x = layer.self_attn\n")
    (tmp_path / "backends/torch/rope.py").write_text("w = getattr(attn, 'q_norm')\n")
    for package in ("gateway", "schedulers"):
        (tmp_path / package).mkdir()
    assert hf_name_lines(tmp_path) == ["backends/torch/rope.py:1: w = getattr(attn, 'q_norm')"]
