"""What of Carousel's layer ops the generic path swaps into the HF model for a step.

vLLM's Transformers backend reached its native Llama's speed by fusing q/k/v and gate/up and
swapping in native norms, not through attention alone; the same here, found generically in
whatever transformers model runs (each part checks the module it replaces, never a name of
the architecture):

- an MLP running Llama's MLP code with a SiLU: gate, up and SiLU in one CPU-kernel pass
  (mlp.py), where Carousel's kernels run;
- sibling `q_proj`/`k_proj`/`v_proj`, and `gate_proj`/`up_proj` of any other MLP: one matmul
  over their fused rows, each member served its slice (siblings.py);
- Llama-formula RMSNorms: the CPU kernels' `rms_norm` (norms.py), where they run, and in a
  Llama-code decoder layer the attention's residual add folded into the post-attention
  norm's kernel (`add_rms_norm`, residual.py); Gemma's `(1 + w)` RMSNorms: the same kernel
  over fp32 rows (norms.py);
- every other plain `nn.Linear`: its packed copy (linears.py), where a pack plan exists.

Each applies only during a step (`StepSwaps.swapped_in`); the fused weights are row views
shared with the HF modules (`fuse_rows`), which compute what they did. `check` runs the probe
forward (probe.py) with the swaps in: a model whose code the swaps do not fit raises there,
at load, and runs without them (logged) instead of failing a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from transformers import PreTrainedModel

from backends.torch.generic.attention import LayerCall
from backends.torch.generic.linears import PackedLinears
from backends.torch.generic.mlp import fuse_mlps
from backends.torch.generic.norms import native_norms, offset_norms
from backends.torch.generic.probe import probe_layers
from backends.torch.generic.residual import fold_residuals
from backends.torch.generic.siblings import SiblingGroup, fuse_siblings, sibling_sets
from backends.torch.generic.swaps import StepSwaps
from backends.torch.kernels import computes
from backends.torch.layers.linear import PackPlan
from backends.torch.logs import engine_log
from backends.torch.models.llama_modules import SIBLINGS, mlp_linears

log = engine_log()


@dataclass(frozen=True)
class FusionReport:
    """How many modules each swap took over (tests and the load log read it)."""

    qkv: int = 0  # attention modules with fused q/k/v
    gate_up: int = 0  # MLPs with fused gate/up (not through the kernel)
    silu_mlps: int = 0  # MLPs through the gate/up/SiLU kernel
    norms: int = 0  # RMSNorms through the kernel
    offset_norms: int = 0  # Gemma's (1 + w) RMSNorms through the kernel in fp32
    folded: int = 0  # decoder layers with the attention's residual add in the norm's kernel
    packed: int = 0  # other linears through their packed copy


@dataclass(frozen=True)
class Fusion:
    """A model's step-time swaps and what they hold."""

    swaps: StepSwaps
    report: FusionReport
    copies: tuple[torch.Tensor, ...]  # the packed copies (Carousel's or oneDNN's)
    packed: PackedLinears | None  # the linears through their own packed copy
    groups: tuple[SiblingGroup, ...] = ()  # the fused siblings

    @property
    def packed_bytes(self) -> int:
        unique = {id(c): c for c in self.copies}
        return sum(c.numel() * c.element_size() for c in unique.values())


def build_fusion(
    hf_model: PreTrainedModel,
    plan: PackPlan | None,
    kernels: ModuleType | None,
    dtypes: tuple[torch.dtype, ...] = (),
    *,
    fuse: bool = True,
) -> Fusion:
    """`hf_model`'s swaps under `plan` (None: no packed copies) and the CPU `kernels` (None:
    none of theirs) computing `dtypes`; `fuse=False`: the packed linears alone."""
    swaps = StepSwaps()
    counts: dict[str, int] = {}
    copies: list[torch.Tensor] = []
    inside: set[int] = set()  # linears a fused MLP computes (never called in its window)
    groups: list[SiblingGroup] = []
    if fuse:
        mlps = fuse_mlps(hf_model, plan, swaps)
        counts["silu_mlps"] = len(mlps)
        for mlp, gate_up in mlps:
            copies.append(gate_up.packed)
            gate, up, _ = mlp_linears(mlp)
            inside |= {id(gate), id(up)}
        for key, names in SIBLINGS:
            sets = [(p, ms) for p, ms in sibling_sets(hf_model, names) if id(ms[0]) not in inside]
            for parent, members in sets:
                group = fuse_siblings(parent, key, members, plan, swaps)
                groups.append(group)
                if group.fused.packed is not None:
                    copies.append(group.fused.packed)
            counts[key] = len(sets)
        if kernels is not None:
            counts["norms"] = len(native_norms(hf_model, kernels, dtypes, swaps))
            counts["folded"] = len(fold_residuals(hf_model, kernels, dtypes, swaps))
            if computes(torch.float32):  # the (1 + w) norms run the fp32 kernel
                counts["offset_norms"] = len(offset_norms(hf_model, kernels, swaps))
    packed = None
    if plan is not None:
        skip = inside | {id(m) for m in hf_model.modules() if swaps.holds(m)}
        packed = PackedLinears(hf_model, plan, skip)
        packed.put_into(swaps)
        copies += packed.copies()
        counts["packed"] = len(packed.swaps)
    return Fusion(swaps, FusionReport(**counts), tuple(copies), packed, tuple(groups))


def check(
    hf_model: PreTrainedModel, fusion: Fusion, layers: dict[int, LayerCall], plan: PackPlan | None
) -> Fusion:
    """`fusion`, if the probe forward runs with its swaps in and sees the `layers` it saw
    without them; else the packed linears alone under `plan` (logged)."""
    try:
        with fusion.swaps.swapped_in():
            seen = probe_layers(hf_model)
        if seen != layers:
            raise ValueError(f"the attention calls changed with the swaps in: {seen} != {layers}")
    except Exception as exc:  # noqa: BLE001  (any failure: serve without the swaps)
        log.warning("generic_fusion_off", model=type(hf_model).__name__, error=repr(exc))
        return build_fusion(hf_model, plan, None, fuse=False)
    return fusion
