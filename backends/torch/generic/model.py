"""`TransformersCausalLM`: any decoder-only transformers model's own code over the paged cache.

The HF model runs as loaded (its buffers real: rotary `inv_freq`, Gemma's `embed_scale`), its
text config's attention implementation set to Carousel's (attention.py) for each forward. The
step's packed tokens go in as one row with their `position_ids` and `use_cache=False`, so the
model's own code (rotary, norms, MLP or MoE routing) runs over `[1, N, hidden]`; attention
reaches the attention backend, which writes K/V into the paged blocks and attends with the
block tables. The logits are the CausalLM's own (`logits_to_keep` at each sequence's last
token): tied heads, `logit_scale` and `final_logit_softcapping` stay transformers'.
Mixture-of-experts blocks keep their router; their experts take transformers' `grouped_mm`
implementation where the class allows it (transformers documents it as the fastest on a CPU).

Like vLLM's Transformers backend, which reached its native Llama's speed this way, a step
swaps some of Carousel's layer ops into the HF modules for its duration, each where the
module it replaces computes the same (fusion.py): sibling `q_proj`/`k_proj`/`v_proj` (and
`gate_proj`/`up_proj`) as one matmul over their fused rows, a Llama-code SiLU MLP as the CPU
kernels' gate/up/SiLU pass, Llama-formula RMSNorms as their `rms_norm` (in a Llama-code
decoder layer, the attention's residual add and the post-attention norm as one
`add_rms_norm`), every other plain `nn.Linear` through its packed copy (with
`prepack_weights` on a CPU). Nothing else of Carousel's (its rotary and K/V write in one
kernel, the MLP's residual add folded into the next layer's norm, the native stack,
quantised linears) runs here: the HF code between those modules runs as written.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.attention import create_backend
from backends.torch.attention.base import AttentionSpec, BatchLayout
from backends.torch.config import TorchBackendConfig
from backends.torch.generic.attention import STEP_KWARG, LayerCall, Step, using_paged_attention
from backends.torch.generic.fusion import build_fusion, check
from backends.torch.generic.linears import PackedLinears
from backends.torch.generic.probe import probe_layers
from backends.torch.kv_cache import KVCache
from backends.torch.layers.linear import PackPlan, pack_plan
from backends.torch.logs import engine_log
from backends.torch.quantization.quantize import QuantizationReport

log = engine_log()

#: whether models are built with fusion.py's swaps (False: only the packed linears, as before
#: them; scripts/step_ab.py's `generic_fusion=false` A/B and the tests set it)
FUSE = True
#: transformers' experts implementation for MoE blocks
EXPERTS_IMPLEMENTATION = "grouped_mm"


def prepare(hf_model: PreTrainedModel) -> dict[int, LayerCall]:
    """Set `hf_model`'s experts implementation (MoE) and read each layer's attention call
    (probe.py): what the KV cache and the backend are built for."""
    if type(hf_model)._can_set_experts_implementation():
        hf_model.config._experts_implementation = EXPERTS_IMPLEMENTATION
    return probe_layers(hf_model)


def specs_of(layers: dict[int, LayerCall]) -> list[AttentionSpec]:
    """The KV cache's layers' specs, in cache order."""
    return [call.spec for call in sorted(layers.values(), key=lambda c: c.index)]


class TransformersCausalLM:
    """The runner's model on the generic path (see the module): the same face as the native
    `PagedCausalLM` (forward, `specs`, `attention`, `kv_cache`, `quantization`, `close`), with
    its packed linears, fused projections and kernel norms and MLPs where the HF modules
    compute the same (fusion.py), but none of its stacks or quantised linears."""

    compiled = False
    native_layers = None
    dense_kernels = None

    def __init__(
        self,
        hf_model: PreTrainedModel,
        kv_cache: KVCache,
        config: TorchBackendConfig,
        layers: dict[int, LayerCall],
        *,
        fuse: bool | None = None,
    ) -> None:
        """`fuse`: fusion.py's swaps (default `FUSE`); else only the packed linears."""
        fuse = FUSE if fuse is None else fuse
        config.check_generic()
        self.hf_model = hf_model
        self.kv_cache = kv_cache
        self.layers = layers
        self.specs = specs_of(layers)
        groups = kv_cache.layout.groups
        self._num_groups = kv_cache.layout.num_groups
        self._group_of = tuple(
            0 if groups is None else groups.group_of(i) for i in range(len(self.specs))
        )
        self.device = kv_cache.k[0].device
        self.attention = create_backend(
            config.attention_backend, kv_cache, self.specs, self.device, native=config.cpu_kernels
        )
        dtype = kv_cache.k[0].dtype
        plan = pack_plan(self.device, dtype, native=config.cpu_kernels)
        self._plan = plan if config.prepack_weights else None
        native = _norm_kernels(self.device, dtype, config.cpu_kernels)
        fusion = build_fusion(hf_model, self._plan, native, (dtype,), fuse=fuse)
        self.fusion = check(hf_model, fusion, layers, self._plan) if fuse else fusion
        log.info("generic_fusion", **dataclasses.asdict(self.fusion.report))
        self.quantization = QuantizationReport(
            mode="none", weight_bytes=_weight_bytes(hf_model, self.fusion.packed_bytes)
        )

    @property
    def linears(self) -> PackedLinears | None:
        """The linears through their own packed copies (None: no pack plan)."""
        return self.fusion.packed

    @property
    def plan(self) -> PackPlan | None:
        """When the `nn.Linear`s take their packed copies (linears.py), None: never."""
        return self._plan

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B', V) at the last scheduled token of sequences `logits_indices` (all)."""
        if len(layout.groups) != self._num_groups - 1:
            raise RuntimeError(
                f"the KV cache has {self._num_groups} groups, the step's layout "
                f"{len(layout.groups) + 1}: schedule it with BlockManager(windows="
                "KVCacheSpec.windows), whose window tables give each group its blocks"
            )
        metas = tuple(self.attention.build_metadata(g) for g in (layout, *layout.groups))
        step = Step(self.attention, metas, self.layers, self._group_of)
        last = layout.cu_seqlens_q[1:] - 1  # (B,)
        if logits_indices is not None:
            last = last[logits_indices]
        with using_paged_attention(self.hf_model.config), self.fusion.swaps.swapped_in():
            out = self.hf_model(
                input_ids=input_ids[None],  # (1, N): the packed step as one row
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=last,
                **{STEP_KWARG: step},
            )
        logits: torch.Tensor = out.logits[0]  # (B', V)
        return logits

    __call__ = forward

    def close(self) -> None:
        """Nothing beyond the KV cache (the runner clears it) is held."""


def _weight_bytes(hf_model: PreTrainedModel, packed: int) -> dict[str, int]:
    """Resident parameter bytes by dtype, each byte once (a tied head, and a tensor-parallel
    rank's head that is a view of some of the embedding's rows, add none), the `packed` bytes
    of the packed copies under the model's dtype."""
    spans: dict[tuple[int, torch.dtype], list[tuple[int, int]]] = {}
    for param in hf_model.parameters():
        start = param.data_ptr()
        size = param.numel() * param.element_size()
        spans.setdefault((param.untyped_storage().data_ptr(), param.dtype), []).append(
            (start, start + size)
        )
    out: dict[str, int] = {}
    for (_, dtype), ranges in spans.items():
        name = str(dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + _covered(ranges)
    name = str(hf_model.dtype).removeprefix("torch.")
    out[name] = out.get(name, 0) + packed
    return out


def _covered(ranges: list[tuple[int, int]]) -> int:
    """How many bytes the union of the [start, end) `ranges` covers."""
    total, reached = 0, None
    for start, end in sorted(ranges):
        if reached is None or start >= reached:
            total += end - start
            reached = end
        elif end > reached:
            total += end - reached
            reached = end
    return total


def _norm_kernels(device: torch.device, dtype: torch.dtype, cpu_kernels: bool) -> ModuleType | None:
    """The CPU kernels where the norms may run on them (asked only with `cpu_kernels` on: the
    first call may build them)."""
    if device.type != "cpu" or not cpu_kernels or not kernels.computes(dtype):
        return None
    return kernels.native()
