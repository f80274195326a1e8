"""Scheduler plug-ins from outside the tree: the policy of docs/schedulers.md, installed as
its own package (an entry point of the `carousel.schedulers` group), served beside orca."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from schedulers import registry
from schedulers.base import SchedulerConfig
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from tests.serve_process import carousel_serve

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "carousel_spf_plugin"
PYPROJECT = f"""
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{PACKAGE}"
version = "0.0.1"

[project.entry-points."carousel.schedulers"]
spf = "{PACKAGE}.spf:ShortestPromptFirst"

[tool.setuptools]
packages = ["{PACKAGE}"]
"""


def policy_source() -> str:
    """The policy exactly as docs/schedulers.md shows it."""
    text = (REPO / "docs" / "schedulers.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match is not None
    return match.group(1)


def test_the_documented_policy_is_under_sixty_lines() -> None:
    assert len(policy_source().splitlines()) < 60


def _spf_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """The documented module, loaded without leaving `spf` in this process's registry."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    path = tmp_path / "spf_doc.py"
    path.write_text(policy_source())
    spec = importlib.util.spec_from_file_location("spf_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_policy_serves_shortest_first_and_overdue_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = _spf_module(tmp_path, monkeypatch).ShortestPromptFirst  # type: ignore[attr-defined]
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    sched = cls(config, BlockManager(64, 4), cls.Options(max_wait_s=5.0))
    seqs = [_seq(i, n) for i, n in enumerate((9, 3, 6))]
    for seq in seqs:
        sched.add(seq)
    assert sched.schedule().seqs == [seqs[1]]  # the shortest prompt
    seqs[0].arrival_time -= 10  # overdue now: ahead of the shorter one
    sched.running.clear()
    sched.block_manager.free(seqs[1])
    assert sched.schedule().seqs == [seqs[0]]


def _seq(i: int, prompt_len: int) -> Sequence:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    return Sequence(i, f"r{i}", list(range(1, prompt_len + 1)), params)


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The documented policy as an installed package of its own, removed afterwards."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "spf.py").write_text(policy_source())
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    if importlib.util.find_spec("setuptools") is not None:
        pip.append("--no-build-isolation")
    subprocess.run([*pip, str(root)], check=True, timeout=300, capture_output=True)
    try:
        yield
    finally:
        uninstall = [sys.executable, "-m", "pip", "uninstall", "-q", "-y", PACKAGE]
        subprocess.run(uninstall, check=False, timeout=120, capture_output=True)


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
@pytest.mark.serial  # it installs into the venv every worker imports from
def test_an_installed_policy_is_found_by_name_and_by_class(installed_plugin: None) -> None:
    names = _python("from schedulers.registry import available_schedulers as a; print(a())")
    assert "'spf'" in names and "'orca'" in names
    by_class = f"{PACKAGE}.spf:ShortestPromptFirst"
    code = f"from schedulers.registry import scheduler_class as c; print(c({by_class!r}).name)"
    assert _python(code) == "spf"


@pytest.mark.slow
@pytest.mark.serial  # its teardown uninstalls from the venv every worker imports from
def test_an_installed_policy_serves_as_an_arm_beside_orca(
    installed_plugin: None, tmp_path: Path
) -> None:
    config = tmp_path / "arms.yaml"
    config.write_text(
        "served_model_name: sim\nbackend: sim\narms:\n"
        "  - {name: orca, scheduler: orca}\n"
        "  - {name: spf, scheduler: spf, max_wait_s: 2}\n"
    )
    args = ["--config", str(config), "--log-level", "warning"]
    with carousel_serve(args, tmp_path) as url:
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for arm in ("orca", "spf"):
            response = httpx.post(
                f"{url}/v1/chat/completions", json=body, headers={"X-Carousel-Arm": arm}
            )
            assert response.status_code == 200, response.text
            assert response.headers["X-Carousel-Arm"] == arm
        trace = httpx.get(f"{url}/debug/trace").json()["arms"]
        assert trace["spf"]["scheduler"] == "spf" and trace["spf"]["iterations"]
