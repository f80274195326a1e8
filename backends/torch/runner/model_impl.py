"""Which model the runner builds over the KV cache: the native `PagedCausalLM` or the generic
`TransformersCausalLM` (`--model-impl`, backends/torch/config.py), chosen once per backend.

`ModelBuilder.of` resolves `auto`, refuses what the chosen path cannot run (the class, from its
config; the settings, by name) and, for the generic path, probes each layer's attention
(generic/probe.py); `specs` size the KV cache, `build` builds the model over it (again for the
kernel switch, over the same cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from backends.torch.attention.base import AttentionSpec
from backends.torch.config import TRANSFORMERS, TorchBackendConfig
from backends.torch.generic.attention import LayerCall
from backends.torch.generic.model import TransformersCausalLM, prepare, specs_of
from backends.torch.generic.support import check_model
from backends.torch.kv_cache import KVCache
from backends.torch.linears import Placement
from backends.torch.model import PagedCausalLM, attention_specs

#: what the runner calls the model through, on either path
PagedModel = PagedCausalLM | TransformersCausalLM


def check_model_impl(hf_model: PreTrainedModel, config: TorchBackendConfig) -> str:
    """The path (`carousel` or `transformers`) `hf_model` takes under `config.model_impl`,
    refusing (ValueError) a class or settings that path cannot run; reads no weight."""
    impl = check_model(hf_model.config, type(hf_model).__name__, config.model_impl, type(hf_model))
    if impl == TRANSFORMERS:
        config.check_generic()
    return impl


@dataclass(frozen=True)
class ModelBuilder:
    """One backend's model path and its attention layers (see the module)."""

    impl: str
    specs: list[AttentionSpec]
    #: the generic path's layer calls by `layer_idx` (None on the native path)
    layers: dict[int, LayerCall] | None

    @classmethod
    def of(cls, hf_model: PreTrainedModel, impl: str) -> ModelBuilder:
        """The builder of `hf_model` (on its device, in its dtype) on path `impl`."""
        if impl != TRANSFORMERS:
            return cls(impl, attention_specs(hf_model), None)
        layers = prepare(hf_model)
        return cls(impl, specs_of(layers), layers)

    @property
    def generic(self) -> bool:
        return self.layers is not None

    def build(
        self,
        hf_model: PreTrainedModel,
        kv_cache: KVCache,
        config: TorchBackendConfig,
        placement: Placement | None,
    ) -> PagedModel:
        """The model over `kv_cache` with `config`'s settings."""
        if self.layers is None:
            return PagedCausalLM(hf_model, kv_cache, config, placement=placement)
        return TransformersCausalLM(hf_model, kv_cache, config, self.layers)
