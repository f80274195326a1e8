"""compose.gpu.yaml's tensor-parallel engine (profile `tp`): a valid `carousel serve` command
over two reserved GPUs, for a model that two ranks can split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from backends.torch.parallel.sizes import ModelDims
from gateway.cli import build_parser, load_settings

ROOT = Path(__file__).resolve().parents[1]
#: Qwen/Qwen2.5-0.5B-Instruct's config.json (the hub is not reachable from the tests)
QWEN25_05B = ModelDims(
    num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936
)


def engine_tp() -> dict[str, Any]:
    services = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())["services"]
    return services["engine-tp"]  # type: ignore[no-any-return]


def test_tp_engine_is_opt_in_and_reserves_one_gpu_per_rank() -> None:
    service = engine_tp()
    assert service["profiles"] == ["tp"]
    [device] = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 2
    assert "gpu" in device["capabilities"]
    assert service["build"]["target"] == "cuda"
    assert service["shm_size"]


def test_tp_engine_command_is_a_valid_serve_of_a_model_two_ranks_can_split() -> None:
    service = engine_tp()
    args = build_parser().parse_args(["serve", *service["command"]])
    settings = load_settings(args)
    assert settings.tensor_parallel_size == 2
    assert settings.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert QWEN25_05B.problems(settings.tensor_parallel_size) == []
    assert service["environment"]["CAROUSEL_DEVICE"] == "cuda"
