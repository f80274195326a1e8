"""scripts/gpu-check.sh's dry run on the CPU: it runs with the GPU parts skipped, without the
packages the GPU image lacks, and writes one well-formed results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the GPU image (torch, transformers, triton; no registry) does not have
MISSING_ON_THE_GPU = ("structlog", "jsonschema_rs", "xgrammar", "pydantic", "pydantic_settings",
                      "fastapi", "uvicorn", "gguf")  # fmt: skip
RUN = """
import sys, runpy
for name in {hidden!r}:
    sys.modules[name] = None
sys.argv = ["gpu_check.py", "--dry-run", "--out", {out!r}]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_the_dry_run_writes_a_well_formed_results_file(tmp_path: Path) -> None:
    code = RUN.format(hidden=MISSING_ON_THE_GPU, out=str(tmp_path))
    env = {**os.environ, "CAROUSEL_CPU_KERNELS": "0"}  # the GPU's path: torch's own kernels
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] is True and results["device"] == "cpu"
    sections = ("bandwidth", "oracle_fp32", "teacher_forced_bf16", "decode_step", "burst",
                "attention", "int4")  # fmt: skip
    for name in sections:
        assert results[name]["status"] in {"pass", "measured", "skipped"}, (name, results[name])
    assert results["bandwidth"]["gb_s"] > 0
    assert results["oracle_fp32"]["status"] == "pass"
    assert set(results["oracle_fp32"]["matching_tokens"]) == {"llama orca", "llama static"}
    for name in sections[2:]:
        assert results[name]["status"] == "skipped"
