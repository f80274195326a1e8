"""Every engine setting reaches what it configures, and a setting a backend would ignore is
refused at start-up, naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from backends.torch.config import TorchBackendConfig
from gateway.arms.engine_factory import (
    scheduler_config,
    serving_options,
    sim_options,
    torch_backend_config,
)
from gateway.cli import main
from gateway.settings.groups import PER_ARM_GROUPS, group_fields, torch_only_defaults
from gateway.settings.load import Settings

#: local-arm settings that configure no engine part: which backend, the served name, the policy
CHOOSERS = {"backend", "served_model_name", "scheduler"}
#: a valid value other than the default, for the string settings
OTHER_TEXT = {
    "model": "another-model",
    "device": "cpu",
    "dtype": "float32",
    "attention_backend": "sdpa",
    "served_model_name": "another-name",
    "scheduler": "static",
    "backend": "sim",
    "quantization": "none",
    "model_impl": "transformers",
    "generation_config": "vllm",
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
}


def engine_setting_names() -> list[str]:
    """The settings of the groups a local arm reads (the model group and the per-arm ones)."""
    groups = ["model", *PER_ARM_GROUPS]
    return [name for group in groups for name, _ in group_fields(group)]


def other_value(name: str) -> Any:
    default = Settings.model_fields[name].default
    if name in OTHER_TEXT:
        return OTHER_TEXT[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 2 + 0.5
    return 3  # an optional number (None by default)


def what_it_configures(settings: Settings) -> dict[str, Any]:
    """Everything a local arm builds from `settings`, per backend."""
    parts: dict[str, Any] = {
        "scheduler": scheduler_config(settings),
        "serving": serving_options(settings),
    }
    if settings.backend == "sim":
        parts["sim"] = sim_options(settings)
    else:
        parts["torch"] = torch_backend_config(settings)
    return parts


def reaches(name: str, backend: str) -> bool:
    """Whether `backend` refuses a non-default `name`, or its arm is built from it."""
    try:
        changed = Settings(backend=backend, **{name: other_value(name)})  # type: ignore[arg-type]
    except ValidationError:
        return True  # refused at start-up (tested below), never silently ignored
    return what_it_configures(changed) != what_it_configures(Settings(backend=backend))


#: what each backend leaves to the other: the weight-free sim loads no model, and the sim's
#: cost-model settings mean nothing to torch (a deployment may mix both kinds of arm)
LEFT_TO_THE_OTHER = {
    "sim": {"model"},
    "torch": {name for name in Settings.model_fields if name.startswith("sim_")},
}


@pytest.mark.parametrize("backend", ["torch", "sim"])
def test_every_engine_setting_reaches_the_config_of_what_it_sets(backend: str) -> None:
    names = [n for n in engine_setting_names() if n not in CHOOSERS]
    assert {"compile", "block_size", "max_num_seqs", "sim_num_blocks"} <= set(names)
    ignored = LEFT_TO_THE_OTHER[backend]
    lost = [name for name in names if name not in ignored and not reaches(name, backend)]
    assert not lost, f"settings that reach nothing of the {backend} backend: {', '.join(lost)}"


def test_the_torch_config_is_built_once_and_frozen() -> None:
    config = torch_backend_config(Settings(block_size=8, compile=True, device="cpu"))
    assert (config.block_size, config.compile, config.device) == (8, True, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(torch_only_defaults()))
def test_the_sim_refuses_each_torch_only_setting_naming_it(name: str) -> None:
    assert {"compile", "device", "tensor_parallel_size"} <= set(torch_only_defaults())
    with pytest.raises(ValidationError, match=rf"sim cannot honour {name}\b"):
        Settings(backend="sim", **{name: other_value(name)})  # type: ignore[arg-type]


def test_tensor_parallelism_refuses_compile_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size 2 cannot honour compile"):
        Settings(tensor_parallel_size=2, compile=True)
    assert main(["serve", "--tensor-parallel-size", "2", "--compile", "--port", "0"]) == 2
    assert "cannot honour compile" in capsys.readouterr().err
    Settings(tensor_parallel_size=2)  # without it: accepted
    Settings(compile=True)


def test_an_arm_of_tensor_parallelism_refuses_the_deployments_compile() -> None:
    arms = [{"name": "a", "scheduler": "orca"}, {"name": "b", "tensor_parallel_size": 2}]
    with pytest.raises(ValidationError, match="cannot honour compile"):
        Settings(compile=True, arms=arms)  # type: ignore[arg-type]
    Settings(compile=False, arms=arms)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["compile", "native_layers"])
def test_the_tensor_parallel_config_refuses_what_its_ranks_cannot_honour(field: str) -> None:
    with pytest.raises(ValueError, match=rf"tensor parallelism cannot honour {field}\b"):
        TorchBackendConfig(tensor_parallel_size=2, **{field: True})  # type: ignore[arg-type]
    assert getattr(TorchBackendConfig(**{field: True}), field) is True  # type: ignore[arg-type]


#: combinations the torch backend refuses or takes (the config owns the rule)
COMBINATIONS = [
    {"compile": True, "quantization": "int8"},
    {"tensor_parallel_size": 2, "compile": True},
    {"tensor_parallel_size": 2, "quantization": "gguf"},
    {"batch_invariant": True, "cpu_kernels": False},
    {"batch_invariant": True, "attention_backend": "sdpa"},
    {"tensor_parallel_size": 2},
    {"compile": True},
    {"batch_invariant": True},
]


@pytest.mark.parametrize("fields", COMBINATIONS)
def test_the_gateway_refuses_exactly_what_the_torch_config_refuses(fields: dict[str, Any]) -> None:
    try:
        TorchBackendConfig(**fields)
        refused = False
    except ValueError:
        refused = True
    assert bool(TorchBackendConfig.unhonoured(fields)) is refused
    try:
        Settings(**fields)
        assert not refused
    except ValidationError as exc:
        assert refused and "cannot honour" in str(exc)


@pytest.mark.parametrize(
    ("fields", "honours"),
    [({}, True), ({"compile": True}, False), ({"tensor_parallel_size": 2}, False),
     ({"batch_invariant": True}, False)],
)  # fmt: skip
def test_quantised_linears_are_honoured_only_on_the_one_path(
    fields: dict[str, Any], honours: bool
) -> None:
    assert TorchBackendConfig(**fields).honours_quantization is honours
