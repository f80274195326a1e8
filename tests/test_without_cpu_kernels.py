"""Without Carousel's compiled CPU kernels (module hidden) the torch backend still runs, on
torch's own kernels, and its greedy output still equals HF `generate` token for token.

Each check runs in a fresh interpreter whose `sys.modules` maps the hidden modules to None,
so any module that imports one at module level fails to import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HIDE = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None
"""

ORACLE = """
import pkgutil
import importlib

import backends.torch
from backends.torch import kernels
from schedulers.base import SchedulerConfig
from tests.test_oracle import MAX_TOKENS, hf_greedy, make_backend, prompts, run_engine
from backends.torch.testing.tiny_models import ARCHITECTURES, tiny_model

for info in pkgutil.walk_packages(backends.torch.__path__, "backends.torch."):
    if not info.name.startswith("backends.torch.cpu_kernels"):
        importlib.import_module(info.name)
assert kernels.native() is None, "the compiled kernels ran although hidden"
for arch in ARCHITECTURES:
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    outputs, _ = run_engine(make_backend(model), "orca", config)
    assert outputs == expected, f"{arch}: greedy output differs from HF generate"
    print(arch, "ok")
"""


def run_hidden(hidden: tuple[str, ...], script: str) -> subprocess.CompletedProcess[str]:
    code = HIDE.format(hidden=hidden) + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_fp32_oracle_holds_with_the_cpu_kernels_hidden() -> None:
    result = run_hidden(("backends.torch.cpu_kernels",), ORACLE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [w for a in ("llama", "mistral", "qwen2", "qwen3")
                                     for w in (a, "ok")]  # fmt: skip


PREFILL = """
import importlib
import pkgutil

import torch

import backends.torch
from backends.torch.runner.inputs import warm_up_layout
from backends.torch.kv_cache import KVCache, KVLayout
from backends.torch.model import PagedCausalLM, attention_specs
from backends.torch.testing.tiny_models import ARCHITECTURES, BLOCK_SIZE, VOCAB, tiny_model

for info in pkgutil.walk_packages(backends.torch.__path__, "backends.torch."):
    importlib.import_module(info.name)
for arch in ARCHITECTURES:
    model = tiny_model(arch)
    spec = attention_specs(model)[0]
    layout = KVLayout(len(model.model.layers), spec.num_kv_heads, spec.head_dim, BLOCK_SIZE,
                      torch.float32)
    paged = PagedCausalLM(model, KVCache(layout, 16, torch.device("cpu")))
    ids = torch.arange(1, 12) % VOCAB
    logits = paged(ids, torch.arange(11), warm_up_layout(11, BLOCK_SIZE, torch.device("cpu")))
    with torch.inference_mode():
        want = model(ids[None]).logits[0, -1]
    assert int(logits[0].argmax()) == int(want.argmax()), arch
    print(arch, "ok")
"""


def test_torch_backend_runs_without_structlog_or_jsonschema_rs() -> None:
    """The GPU image has torch, triton and transformers, but neither of these two."""
    result = run_hidden(("structlog", "jsonschema_rs"), PREFILL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [w for a in ("llama", "mistral", "qwen2", "qwen3")
                                     for w in (a, "ok")]  # fmt: skip
