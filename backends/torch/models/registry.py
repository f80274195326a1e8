"""HF architecture names -> the family file that implements them (the native path)."""

from __future__ import annotations

from typing import Any

from backends.torch.models.base import ArchitectureFamily, ModelWeights
from backends.torch.models.llama import LlamaFamily

FAMILIES: tuple[ArchitectureFamily, ...] = (LlamaFamily(),)
_BY_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.architectures}
_BY_MODEL_TYPE = {mt: arch for f in FAMILIES for arch, mt in f.architectures.items()}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCHITECTURE)


def architecture_of(config: Any) -> str:
    """The config's causal-LM class name (from `architectures`, else from `model_type`)."""
    if getattr(config, "architectures", None):
        return str(config.architectures[0])
    model_type = str(getattr(config, "model_type", ""))
    return _BY_MODEL_TYPE.get(model_type, model_type or "<unknown>")


def check_architecture(architecture: str) -> None:
    """Raise ValueError unless a family of models/ implements `architecture`."""
    if architecture not in _BY_ARCHITECTURE:
        raise ValueError(
            f"unsupported model architecture {architecture!r}: the torch backend supports "
            f"{', '.join(supported_architectures())}"
        )


def family_of(architecture: str) -> ArchitectureFamily:
    """The family implementing `architecture` (ValueError if none)."""
    check_architecture(architecture)
    return _BY_ARCHITECTURE[architecture]


def family_of_gguf(gguf_architecture: str) -> ArchitectureFamily | None:
    """The family of a GGUF file's `general.architecture` (llama.cpp's name: `llama`, ...)."""
    architecture = _BY_MODEL_TYPE.get(gguf_architecture)
    return None if architecture is None else _BY_ARCHITECTURE[architecture]


def weights_of(hf_model: Any) -> ModelWeights:
    """`hf_model` by role, through its family (ValueError for an unsupported class)."""
    return family_of(type(hf_model).__name__).weights(hf_model)
