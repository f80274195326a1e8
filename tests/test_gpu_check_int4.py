"""scripts/gpu_check_int4.py runs here: on a machine without CUDA it writes a clean skip."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_int4.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_without_cuda_the_int4_gpu_check_writes_a_skip(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_int4", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "int4.json"
    module.main(str(out))
    assert json.loads(out.read_text()) == {"status": "skipped", "reason": "no CUDA device"}
