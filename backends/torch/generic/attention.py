"""The attention function transformers calls in every layer of a model on the generic path.

Registered with transformers' `AttentionInterface` as `carousel_paged`, with no mask function:
transformers' mask builders exit early for an implementation they have no mask function for
(masking_utils `_preprocess_mask_arguments`), so no (N, N) mask is ever built for the packed
row. The step's state reaches the function through the model's `**kwargs` (`STEP_KWARG`), not
through a global: the attention backend with this step's metadata, and each layer's spec. The
function finds its layer by `module.layer_idx`, writes the new K/V into the paged cache and
attends with the block tables; a layer with attention soft-capping (Gemma 2) takes
softcap.py's torch-ops attention over the same cache instead, since no backend caps scores.

A probe (`Probe`, probe.py) goes down the same kwargs to record what each layer passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from backends.torch.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from backends.torch.generic.softcap import softcap_attention

NAME = "carousel_paged"
#: the model-forward keyword argument carrying the step (or a probe) down to every layer
STEP_KWARG = "carousel_step"


class Probe(Protocol):
    """What a probe forward hands down instead of a step (probe.py)."""

    def record(
        self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, call: dict[str, Any]
    ) -> None: ...


@dataclass(frozen=True)
class LayerCall:
    """What one layer passes to its attention, as the probe saw it: the spec plus softcap."""

    index: int  # its layer in the KV cache
    spec: AttentionSpec
    softcap: float | None


@dataclass(frozen=True)
class Step:
    """One forward's attention state, handed down the model's kwargs: the backend's metadata
    for each KV cache group (kv_cache.py's `KVGroups`; one without groups) and each cache
    layer's group."""

    backend: AttentionBackend[Any]
    metas: tuple[AttentionMetadata, ...]
    layers: dict[int, LayerCall]  # by the HF module's `layer_idx`
    group_of: tuple[int, ...]  # by cache layer

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        call: dict[str, Any],
    ) -> torch.Tensor:
        """Attention output (1, N, nh, hd) of layer `module` for its (1, n, N, hd) Q/K/V."""
        layer = self.layers[cast(int, module.layer_idx)]
        check_call(layer, call)
        meta = self.metas[self.group_of[layer.index]]
        q = query[0].transpose(0, 1).contiguous()  # (N, nh, hd)
        k = key[0].transpose(0, 1)  # (N, nkv, hd)
        v = value[0].transpose(0, 1)
        self.backend.write_kv(layer.index, k, v, meta)
        if layer.softcap is not None:
            out = softcap_attention(
                self.backend.kv_cache, layer.index, layer.spec, layer.softcap, q, meta.layout
            )
        else:
            out = self.backend.attend(layer.index, q, k.contiguous(), v.contiguous(), meta)
        return out[None]  # (1, N, nh, hd)


def check_call(layer: LayerCall, call: dict[str, Any]) -> None:
    """Raise where a layer passes other scaling, window or softcap than it did to the probe
    (the KV cache and the backend were built for those)."""
    spec = layer.spec
    seen = (call["scaling"], call["sliding_window"], call["softcap"])
    if seen != (spec.scale, spec.sliding_window, layer.softcap):
        raise RuntimeError(
            f"layer {layer.index} called attention with scaling, sliding_window, softcap {seen}, "
            f"not the {(spec.scale, spec.sliding_window, layer.softcap)} it was built for"
        )


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` (1, nh, N, hd), `key` and `value`
    (1, nkv, N, hd) of the packed row; returns (1, N, nh, hd) and no weights."""
    step: Step | Probe | None = kwargs.pop(STEP_KWARG, None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    call = {"scaling": scaling, "sliding_window": sliding_window, "softcap": softcap, **kwargs}
    if attention_mask is not None:  # the model built a mask of its own: the probe refuses it
        call["attention_mask"] = attention_mask
    if isinstance(step, Step):
        return step.attend(module, query, key, value, call), None
    if step is None:
        raise RuntimeError(f"{NAME} attention was called outside a Carousel step")
    step.record(module, query, key, call)
    return query.new_zeros(query.shape).transpose(1, 2), None


@contextlib.contextmanager
def using_paged_attention(config: PretrainedConfig) -> Iterator[None]:
    """`config`'s attention implementation set to `NAME` for the block, then given back.

    NOTE: only for the duration of a forward: the same HF model may serve `generate`, or
    another arm's native path, between two steps (each one at a time: the device thread).
    """
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


AttentionInterface.register(NAME, paged_attention_forward)
