"""The `engine_path` fixture: every way the CPU forward can run, each one test parameter.

Each attention backend available on the CPU, eager, `auto`'s backend with the compiled
decoder layer (`compile=True`, backends/torch/stacks/compiled_layer.py) where a C++ compiler
is there, and
`cpu_paged` in the `batch_invariant` mode (every token through the decode kernel). For
`inductor_paged` it lowers `MIN_PAGED_DECODES` to 1, so every decode of the small test
batches runs through the compiled kernel (its SDPA fallback for few decodes is `sdpa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from backends.torch.attention import AUTO, available_backends
from backends.torch.stacks import inductor


@dataclass(frozen=True)
class EnginePath:
    """The `TorchBackend` keyword arguments of one forward path."""

    attention_backend: str
    compile: bool
    batch_invariant: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {
            "attention_backend": self.attention_backend,
            "compile": self.compile,
            "batch_invariant": self.batch_invariant,
        }

    def __str__(self) -> str:
        mode = "-compiled" if self.compile else "-batch-invariant" if self.batch_invariant else ""
        return f"{self.attention_backend}{mode}"


ENGINE_PATHS = [EnginePath(name, False) for name in available_backends(torch.device("cpu"))]
if inductor.compiler_available():
    ENGINE_PATHS.append(EnginePath(AUTO, True))
if "cpu_paged" in available_backends(torch.device("cpu")):
    ENGINE_PATHS.append(EnginePath("cpu_paged", False, batch_invariant=True))


@pytest.fixture(name="engine_path", params=ENGINE_PATHS, ids=str)
def engine_path_fixture(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> EnginePath:
    path: EnginePath = request.param
    if "inductor_paged" in available_backends(torch.device("cpu")):
        from backends.torch.attention import inductor_paged

        monkeypatch.setattr(inductor_paged, "MIN_PAGED_DECODES", 1)
    return path
