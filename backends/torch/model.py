"""Selective batching over a paged KV cache: a model's forward, built once in its final form.

Every op but attention (embedding, RMSNorm, QKV/output projections, MLP, final norm, lm_head)
runs once over the flat `[N, hidden]` tensor of all scheduled tokens of all sequences, with
the Q/K/V projections fused into one matmul (layers/fused.py). Only attention is per sequence,
and it sits behind the attention seam (attention/): the backend stores the new K/V into the
paged cache and attends each token to its own sequence's context. No padding of the token
dimension.

Built in this order, each part from the one before and never replaced afterwards: the model's
weights by role (models/, the only reader of HF names), every projection with its method
(linears.py: packed, quantised, tensor-parallel), the layer ops (layers/, attention/), and the
stack of decoder layers (stacks/: eager, native or compiled).
"""

from __future__ import annotations

import dataclasses
import time
from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedModel

from backends.torch import kernels
from backends.torch.attention import create_backend
from backends.torch.attention.base import AttentionSpec, BatchLayout
from backends.torch.attention.rotary import RotaryWriteKV
from backends.torch.config import TorchBackendConfig
from backends.torch.kv_cache import KVCache
from backends.torch.layers.activation import GateUpSilu
from backends.torch.layers.layernorm import RMSNorm
from backends.torch.layers.linear import PackPlan, invariant_plan, pack_plan
from backends.torch.linears import LayerLinears, Placement, build_linears
from backends.torch.models import ModelWeights, weights_of
from backends.torch.quantization.quantize import resolve_mode
from backends.torch.runner import inputs
from backends.torch.stacks import LayerStack, inductor
from backends.torch.stacks.compiled import CompiledStack, compilable
from backends.torch.stacks.eager import EagerStack, LayerOps
from backends.torch.stacks.native import NativeDecodeLayers, NativeStack


def attention_specs(hf_model: PreTrainedModel) -> list[AttentionSpec]:
    """Each decoder layer's attention geometry, read off that layer's own projections."""
    return [layer.spec for layer in weights_of(hf_model).layers]


def _dense_kernels(weights: ModelWeights) -> ModuleType | None:
    """The compiled kernels the layer ops may take, where they compute what this model's own
    modules do (an RMSNorm of the Llama kind, SiLU in the MLP, fp32 or bf16 on CPU); else None.
    """
    weight = weights.lm_head_weight
    if weight.device.type != "cpu" or not kernels.computes(weight.dtype):
        return None
    if weights.hidden_act != "silu":
        return None
    norms = [n for layer in weights.layers for n in (layer.input_norm, layer.post_norm)]
    norms.append(weights.final_norm)
    if not all(n.kernel_formula and n.weight.dtype == weight.dtype for n in norms):
        return None
    return kernels.native()


class PagedCausalLM:
    """The forward pass of a causal LM of a family in models/ over a paged KV cache.

    Each layer op (norm with residual, linear, gate-up-SiLU, rotary with the K/V write,
    attention) chose its implementation when the model was built (layers/, attention/), and so
    did the stack of decoder layers (`stack`: eager, native or compiled): the forward has one
    path. `placement` makes it one rank's part of a tensor-parallel model (parallel/layers.py).
    """

    def __init__(
        self,
        hf_model: PreTrainedModel,
        kv_cache: KVCache,
        config: TorchBackendConfig | None = None,
        *,
        placement: Placement | None = None,
        **fields: Any,
    ) -> None:
        """Reads the prepack, attention, kernel, MLP, compile and native-layer settings of
        `config` (keyword arguments: fields of a config built on the spot, as for
        `TorchBackend`)."""
        config = dataclasses.replace(config or TorchBackendConfig(), **fields)
        cpu_kernels = config.cpu_kernels
        self.weights = weights = weights_of(hf_model)  # ValueError for an unsupported class
        self.specs = [layer.spec for layer in weights.layers]
        weight = weights.lm_head_weight
        self.device = weight.device
        plan = pack_plan(weight.device, weight.dtype, native=cpu_kernels)
        plan = plan if config.prepack_weights else None
        if config.batch_invariant:  # one kernel for every row count (layers/linear.py)
            plan = invariant_plan(plan)
        self.dense_kernels = _dense_kernels(weights) if cpu_kernels else None
        if config.batch_invariant and self.dense_kernels is None:
            # torch's own norms may split a row's sum across threads when rows are few
            raise ValueError("batch_invariant needs Carousel's CPU kernels for this model's ops")
        self._plan = plan
        # the graph calls gate and up one by one (stacks/compiled_layer.py): no GateUp for it
        compiled = config.compile and placement is None and compilable(self.specs)
        linears = build_linears(
            hf_model, weights, config,
            mode=resolve_mode(hf_model, config),
            plan=plan,
            # SiLU MLPs (what dense_kernels checks): linear_silu_mul computes theirs
            fuse_mlp=config.fuse_mlp and self.dense_kernels is not None and not compiled,
            placement=placement,
        )  # fmt: skip
        self.linears: list[LayerLinears] = linears.layers
        self.lm_head_linear = linears.lm_head
        self.quantization = linears.quantization
        self.embed = weights.embed if placement is None else placement.embedding(weights.embed)
        self.rotary_embedding = weights.rotary
        self.kv_cache = kv_cache
        self.attention = create_backend(
            config.attention_backend, kv_cache, self.specs, weight.device, native=cpu_kernels,
            batch_invariant=config.batch_invariant,
        )  # fmt: skip
        self.final_norm = RMSNorm(weights.final_norm, self.device, self.dense_kernels)
        self.ops = self._layer_ops()
        self.stack: LayerStack = self._choose_stack(
            config, compiled=compiled, parallel=placement is not None
        )

    def _layer_ops(self) -> list[LayerOps]:
        """Each layer's ops, their implementations chosen here, once."""
        device, dense = self.device, self.dense_kernels
        return [
            LayerOps(
                input_norm=RMSNorm(layer.input_norm, device, dense),
                post_norm=RMSNorm(layer.post_norm, device, dense),
                rotary=RotaryWriteKV(
                    layer.index, layer.head_norms, layer.spec, self.attention, device, dense
                ),
                mlp_act=GateUpSilu(layer.act_fn, device, dense, act_is_silu=layer.act_is_silu),
                linears=lin,
            )
            for layer, lin in zip(self.weights.layers, self.linears, strict=True)
        ]

    def _choose_stack(
        self, config: TorchBackendConfig, *, compiled: bool, parallel: bool
    ) -> LayerStack:
        """The decoder-layer stack (stacks/), chosen once from the config, tensor
        parallelism and the kernels' availability."""
        eager = EagerStack(self.ops, self.attention)
        if compiled:
            return self._compiled_or(eager)
        # NOTE: a rank's row-parallel linears all-reduce between the kernels (config.py
        # refuses native_layers=True with tensor parallelism)
        if config.native_layers is False or parallel:
            return eager
        if not all(op.rotary.uses_kernels for op in self.ops):
            return eager
        norms = [
            (ops.input_norm.weight, ops.input_norm.eps, ops.post_norm.weight, ops.post_norm.eps)
            for ops in self.ops
        ]
        native = NativeDecodeLayers.build(
            self.dense_kernels, self.linears, norms, self.specs, self.attention, self._plan
        )
        return eager if native is None else NativeStack(native, eager)

    def _compiled_or(self, eager: EagerStack) -> LayerStack:
        """The compiled stack, compiled now (logged) for one token and for a dynamic token
        count so no request waits for the compiler; `eager` where the compiler fails (which
        must not keep the server from starting)."""
        began = time.monotonic()
        inductor.log.info("compiling the decoder layer (torch.compile, Inductor)")
        try:
            stack = CompiledStack(self.weights.layers, self.linears, self.attention)
            for num_tokens in (1, 2):
                self._warm_up(stack, num_tokens)
        except Exception:
            inductor.log.exception("compiling the decoder layer failed; running it eager")
            return eager
        inductor.log.info("decoder layer compiled", seconds=round(time.monotonic() - began, 1))
        return stack

    @property
    def compiled(self) -> bool:
        """Whether the layers run through the compiled graph (`--compile` took)."""
        return isinstance(self.stack, CompiledStack)

    @property
    def native_layers(self) -> NativeDecodeLayers | None:
        """The native decode stack's call, where the native stack was chosen."""
        return self.stack.native if isinstance(self.stack, NativeStack) else None

    @property
    def plan(self) -> PackPlan | None:
        """When the linears take their packed copies (layers/linear.py), None: never."""
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
        return self._forward(self.stack, input_ids, positions, layout, logits_indices)

    __call__ = forward

    def _forward(
        self,
        stack: LayerStack,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = self.attention.build_metadata(layout)
        hidden = self.embed(input_ids)  # (N, H)
        cos, sin = self.rotary_embedding(hidden, positions[None])  # (1, N, hd) each
        rope = (cos[0, :, None, :], sin[0, :, None, :])  # (N, 1, hd): broadcast over heads
        hidden = stack(hidden, rope, meta)
        last = layout.cu_seqlens_q[1:] - 1  # (B,)
        if logits_indices is not None:
            last = last[logits_indices]
        # NOTE: the final norm is per token, so norming only the rows we need is identical.
        return self.lm_head_linear(self.final_norm(hidden[last]))  # (B', V)

    @torch.inference_mode()
    def _warm_up(self, stack: LayerStack, num_tokens: int) -> None:
        """One forward through `stack` over `num_tokens` fresh tokens, written to the first
        blocks (before the first request: nobody holds them yet, see
        `inputs.warm_up_layout`)."""
        device = self.kv_cache.k[0].device
        batch_layout = inputs.warm_up_layout(num_tokens, self.kv_cache.block_size, device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        self._forward(stack, ids, positions, batch_layout)

    def close(self) -> None:
        """Let go of the stack and the ops (the native stack holds every layer's K/V tensors
        too), so the KV cache's memory is freed with the backend's reference; the model does
        not run after this."""
        self.__dict__.pop("stack", None)
        self.__dict__.pop("ops", None)
