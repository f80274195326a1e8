"""Each layer's attention as the model's own code calls it, read by one probe forward.

Before the KV cache is sized, the model runs one token with a `_Recorder` handed down to the
attention function (attention.py) in place of a step: each attention call records its layer
(`module.layer_idx`), its Q and K heads and head size, and the per-call `scaling`,
`sliding_window` and `softcap` the modeling code passes (Gemma's `query_pre_attn_scalar`,
`layer_types` windows, Phi-3's and Qwen's own head sizes), so the specs are what the forward
will ask for, not a reading of config names that each architecture spells its own way. A call
the backends cannot serve (sinks, a position bias, a mask of the model's own, a layer called
twice, unequal K/V shapes across layers, non-causal attention) is refused here, naming the
class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from backends.torch.attention.base import AttentionSpec
from backends.torch.generic.attention import STEP_KWARG, LayerCall, using_paged_attention

#: keyword arguments an attention call may carry that change nothing for a causal decoder
BENIGN_KWARGS = frozenset({
    "position_ids", "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "dropout", "is_causal",
})  # fmt: skip


@dataclass
class _Recorder:
    """The probe handed down the kwargs: the calls by `layer_idx`, in call order."""

    calls: dict[int, tuple[AttentionSpec, float | None]] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)

    def record(
        self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, call: dict[str, Any]
    ) -> None:
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or idx in self.calls:
            self.refusals.append(f"an attention call without its own layer index ({idx!r})")
            return
        extra = sorted(set(call) - {"scaling", "sliding_window", "softcap"} - BENIGN_KWARGS)
        if extra or call.get("is_causal", True) is False or not getattr(module, "is_causal", True):
            reason = f"passes {', '.join(extra)}" if extra else "is not causal"
            self.refusals.append(f"layer {idx}'s attention {reason}")
        window = call["sliding_window"]
        spec = AttentionSpec(
            num_heads=int(q.shape[1]),
            num_kv_heads=int(k.shape[1]),
            head_dim=int(q.shape[-1]),
            scale=float(call["scaling"]),
            sliding_window=None if window is None else int(window),
        )
        softcap = call["softcap"]
        self.calls[idx] = (spec, None if softcap is None else float(softcap))


def probe_layers(hf_model: PreTrainedModel) -> dict[int, LayerCall]:
    """Each attention layer's call by `layer_idx`, its KV-cache index in call order (ValueError
    naming the class where the backends cannot serve the calls)."""
    recorder = _Recorder()
    device = next(hf_model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode(), using_paged_attention(hf_model.config):
        hf_model(input_ids=ids, position_ids=ids, use_cache=False, **{STEP_KWARG: recorder})
    layers = {
        idx: LayerCall(index, spec, softcap)
        for index, (idx, (spec, softcap)) in enumerate(recorder.calls.items())
    }
    shapes = {(c.spec.num_kv_heads, c.spec.head_dim) for c in layers.values()}
    if not layers:
        recorder.refusals.append("no attention call reached Carousel's attention function")
    elif len(shapes) > 1:
        recorder.refusals.append(f"its layers' K/V shapes differ {sorted(shapes)}")
    if recorder.refusals:
        raise ValueError(
            f"{type(hf_model).__name__} cannot run on the generic (transformers) path: "
            + "; ".join(recorder.refusals)
        )
    return layers
