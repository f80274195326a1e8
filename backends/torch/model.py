"""Selective batching over a paged KV cache, reusing the modules of a loaded HF causal LM.

Every op but attention (embedding, RMSNorm, QKV/output projections, MLP, final norm, lm_head)
runs once over the flat `[N, hidden]` tensor of all scheduled tokens of all sequences, with
the Q/K/V projections fused into one matmul (fused.py). Only attention is per sequence, and
it sits behind the attention seam (attention/): the backend stores the new K/V into the
paged cache and attends each token to its own sequence's context. No padding of the token
dimension.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from backends.torch import inductor, inputs, kernels
from backends.torch.attention import create_backend
from backends.torch.attention.base import AttentionMetadata, AttentionSpec, BatchLayout
from backends.torch.attention.rotary import RotaryWriteKV
from backends.torch.config import TorchBackendConfig
from backends.torch.decode_stack import NativeDecodeLayers
from backends.torch.fused import FusedLayer, fuse_layer
from backends.torch.kv_cache import KVCache
from backends.torch.layers.activation import GateUpSilu
from backends.torch.layers.layernorm import RMS_NORMS, RMSNorm
from backends.torch.layers.quant_linear import QuantLinear
from backends.torch.loader import check_architecture
from backends.torch.packed import (
    GateUp,
    Linear,
    PackPlan,
    cached_gate_up,
    cached_linear,
    forget_gate_up,
    fusable_gate_up,
    invariant_plan,
    pack_plan,
)
from backends.torch.quantization import NONE, quantize_linears, resolve_mode


@dataclass(frozen=True)
class _LayerLinears:
    """One decoder layer's projections as `Linear`s (prepacked where that pays), each a
    `QuantLinear` over its `Linear` where `--quantization` gave it a quantised copy.

    With `gate_up` (Carousel's kernels, `fuse_mlp`), decode-sized MLP inputs go through it,
    and gate and up keep only their plain weights (larger batches take F.linear anyway).
    """

    qkv: Linear | QuantLinear
    o_proj: Linear | QuantLinear
    gate: Linear | QuantLinear
    up: Linear | QuantLinear
    down: Linear | QuantLinear
    gate_up: GateUp | None = None

    @classmethod
    def of(
        cls, layer: Any, fused: FusedLayer, plan: PackPlan | None, *, fuse_mlp: bool = False
    ) -> _LayerLinears:
        attn, mlp = layer.self_attn, layer.mlp
        gate_w, up_w = mlp.gate_proj.weight, mlp.up_proj.weight
        gate_up = None
        if fuse_mlp and mlp.gate_proj.bias is None and fusable_gate_up(plan, gate_w, up_w):
            assert plan is not None
            gate_up = cached_gate_up(mlp, gate_w, up_w, plan)

        def wrap(key: str, module: Any, own_plan: PackPlan | None = plan) -> Linear:
            return cached_linear(layer, key, module.weight, module.bias, own_plan)

        mlp_plan = None if gate_up is not None else plan
        return cls(
            qkv=cached_linear(layer, "qkv", fused.qkv_weight, fused.qkv_bias, plan),
            o_proj=wrap("o_proj", attn.o_proj),
            gate=wrap("gate", mlp.gate_proj, mlp_plan),
            up=wrap("up", mlp.up_proj, mlp_plan),
            down=wrap("down", mlp.down_proj),
            gate_up=gate_up,
        )


def _sliding_window(attn: nn.Module, config: object) -> int | None:
    """Per-layer window (Qwen2/3 set it on the module), else the config's (Mistral)."""
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    return None if window is None else int(window)


def attention_specs(hf_model: PreTrainedModel) -> list[AttentionSpec]:
    """Each decoder layer's attention geometry, read off that layer's own projections."""
    specs = []
    for layer in hf_model.model.layers:
        attn = layer.self_attn
        head_dim = int(attn.head_dim)
        specs.append(
            AttentionSpec(
                num_heads=attn.q_proj.weight.shape[0] // head_dim,
                num_kv_heads=attn.k_proj.weight.shape[0] // head_dim,
                head_dim=head_dim,
                scale=float(attn.scaling),
                sliding_window=_sliding_window(attn, hf_model.config),
            )
        )
    return specs


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), (N, 1, hd) each
#: a forward over every decoder layer: (hidden, rope, meta) -> hidden
LayerStack = Callable[[torch.Tensor, Rope, AttentionMetadata], torch.Tensor]


def _dense_kernels(hf_model: PreTrainedModel) -> ModuleType | None:
    """The compiled kernels the layer ops may take, where they compute what this model's own
    modules do (an RMSNorm of the Llama kind, SiLU in the MLP, fp32 or bf16 on CPU); else None.
    """
    weight = hf_model.lm_head.weight
    if weight.device.type != "cpu" or not kernels.computes(weight.dtype):
        return None
    if getattr(hf_model.config, "hidden_act", None) != "silu":
        return None
    norms = [m for layer in hf_model.model.layers
             for m in (layer.input_layernorm, layer.post_attention_layernorm)]  # fmt: skip
    norms.append(hf_model.model.norm)
    if not all(type(m).__name__ in RMS_NORMS and m.weight.dtype == weight.dtype for m in norms):
        return None
    return kernels.native()


class PagedCausalLM:
    """The forward pass of a Llama/Mistral/Qwen2/Qwen3 HF model over a paged KV cache.

    Each layer op (norm with residual, linear, gate-up-SiLU, rotary with the K/V write,
    attention) chose its implementation when the model loaded (layers/, attention/), and so
    did the stack of decoder layers (`run_layers`: eager, the native decode stack, or the
    compiled graph): the forward has one path.
    """

    def __init__(
        self,
        hf_model: PreTrainedModel,
        kv_cache: KVCache,
        config: TorchBackendConfig | None = None,
        **fields: Any,
    ) -> None:
        """Reads the prepack, attention, kernel, MLP and native-layer settings of `config`
        (keyword arguments: fields of a config built on the spot, as for `TorchBackend`)."""
        config = dataclasses.replace(config or TorchBackendConfig(), **fields)
        cpu_kernels = config.cpu_kernels
        check_architecture(type(hf_model).__name__)
        base = hf_model.model
        self.embed_tokens = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.specs = attention_specs(hf_model)
        weight = hf_model.lm_head.weight
        self.device = weight.device
        plan = pack_plan(weight.device, weight.dtype, native=cpu_kernels)
        plan = plan if config.prepack_weights else None
        if config.batch_invariant:  # one kernel for every row count (packed.py)
            plan = invariant_plan(plan)
        self.dense_kernels = _dense_kernels(hf_model) if cpu_kernels else None
        if config.batch_invariant and self.dense_kernels is None:
            # torch's own norms may split a row's sum across threads when rows are few
            raise ValueError("batch_invariant needs Carousel's CPU kernels for this model's ops")
        self._plan = plan
        quantization = resolve_mode(hf_model, config)
        # SiLU MLPs (what dense_kernels checks): linear_silu_mul computes theirs
        fuse_mlp = config.fuse_mlp and self.dense_kernels is not None
        self.linears = [
            _LayerLinears.of(layer, fuse_layer(layer), plan, fuse_mlp=fuse_mlp)
            for layer in self.layers
        ]
        self.lm_head_linear = cached_linear(hf_model.lm_head, "lm_head", weight, None, plan)
        if config.batch_invariant:
            self._check_one_kernel()
        self._quantize(hf_model, config, quantization)
        self.kv_cache = kv_cache
        self.attention = create_backend(
            config.attention_backend, kv_cache, self.specs, weight.device, native=cpu_kernels,
            batch_invariant=config.batch_invariant,
        )  # fmt: skip
        self.final_norm = RMSNorm(self.norm, self.device, self.dense_kernels)
        self._build_ops()
        self.compiled = False  # see enable_compiled
        # decode-only steps: every layer in one native call (decode_stack.py)
        self.native_layers = (
            NativeDecodeLayers.build(
                self.dense_kernels,
                self.linears,
                self._norms(),
                self.specs,
                self.attention,
                plan,
            )  # fmt: skip
            if config.native_layers is not False and all(op.uses_kernels for op in self.rotary)
            else None
        )

    def _check_one_kernel(self) -> None:
        """`batch_invariant`: refuse where a linear kept no packed copy (it would take
        `F.linear`, whose sums may depend on the step's rows)."""
        for lin in self.linears:
            mlp = (lin.gate, lin.up) if lin.gate_up is None else ()  # else gate_up takes all
            ops = (lin.qkv, lin.o_proj, *mlp, lin.down)
            if not all(isinstance(op, Linear) and op.plan is not None for op in ops):
                raise ValueError("batch_invariant: a linear of this model has no packed copy")
        if self.lm_head_linear.plan is None:
            raise ValueError("batch_invariant: the LM head has no packed copy")

    def _quantize(self, hf_model: PreTrainedModel, config: TorchBackendConfig, mode: str) -> None:
        """Give the linears their quantised copies where `mode` asks (quantization.py)."""
        ops, head, self.quantization = quantize_linears(
            hf_model, config, mode, self.linears, self.lm_head_linear
        )
        if mode == NONE:
            return
        self.linears = [
            dataclasses.replace(lin, **layer_ops)
            for lin, layer_ops in zip(self.linears, ops, strict=True)
        ]
        self.lm_head_linear = head

    def _build_ops(self) -> None:
        """Each layer's ops, their implementations chosen here, once."""
        device, dense = self.device, self.dense_kernels
        self.input_norms = [RMSNorm(layer.input_layernorm, device, dense) for layer in self.layers]
        self.post_norms = [
            RMSNorm(layer.post_attention_layernorm, device, dense) for layer in self.layers
        ]
        self.rotary = [
            RotaryWriteKV(index, layer.self_attn, spec, self.attention, device, dense)
            for index, (layer, spec) in enumerate(zip(self.layers, self.specs, strict=True))
        ]
        self.mlp_act = [GateUpSilu(layer.mlp.act_fn, device, dense) for layer in self.layers]

    def _norms(self) -> list[tuple[torch.Tensor, float, torch.Tensor, float]]:
        """Each layer's (input norm weight, eps, post-attention norm weight, eps)."""
        return [
            (pre.weight, pre.eps, post.weight, post.eps)
            for pre, post in zip(self.input_norms, self.post_norms, strict=True)
        ]

    @property
    def native_layers(self) -> NativeDecodeLayers | None:
        """The native decode stack, or None (tensor parallelism and `close` drop it)."""
        return self._native_layers

    @native_layers.setter
    def native_layers(self, stack: NativeDecodeLayers | None) -> None:
        self._native_layers = stack
        self._choose_layers()

    def _choose_layers(self) -> None:
        """Pick the implementation of the decoder-layer stack, once per change of set-up."""
        self.run_layers: LayerStack
        if self.compiled:
            self.run_layers = self._compiled_layers
        elif self._native_layers is not None:
            self.run_layers = self._native_decode_layers
        else:
            self.run_layers = self._eager_layers

    def compilable(self) -> bool:
        """Whether the compiled layer (dense.py) can run this model here; logs why not."""
        if not inductor.compiler_available():
            inductor.log.warning("no C++ compiler for Inductor: the forward runs eager")
            return False
        if len({(s.num_heads, s.num_kv_heads, s.head_dim) for s in self.specs}) != 1:
            inductor.log.warning("layers of different shapes: the forward runs eager")
            return False
        return True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B', V) at the last scheduled token of sequences `logits_indices` (all)."""
        meta = self.attention.build_metadata(layout)
        hidden = self.embed_tokens(input_ids)  # (N, H)
        cos, sin = self.rotary_emb(hidden, positions[None])  # (1, N, hd) each
        rope = (cos[0, :, None, :], sin[0, :, None, :])  # (N, 1, hd): broadcast over heads
        hidden = self.run_layers(hidden, rope, meta)
        last = layout.cu_seqlens_q[1:] - 1  # (B,)
        if logits_indices is not None:
            last = last[logits_indices]
        # NOTE: the final norm is per token, so norming only the rows we need is identical.
        return self.lm_head_linear(self.final_norm(hidden[last]))  # (B', V)

    __call__ = forward

    def _eager_layers(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every decoder layer op by op; each residual add is folded into the norm after it.

        `hidden` (fresh from the embedding) is the residual stream, updated in place.
        """
        num_layers = len(self.layers)
        x = self.input_norms[0](hidden)
        for layer_idx in range(num_layers):
            x = self.post_norms[layer_idx](self._attention(layer_idx, x, rope, meta), hidden)
            mlp_out = self._mlp(layer_idx, x)
            if layer_idx + 1 < num_layers:
                x = self.input_norms[layer_idx + 1](mlp_out, hidden)
            else:
                hidden += mlp_out
        return hidden

    def _native_decode_layers(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """A decode-only step in the native stack's one call; any other step eager."""
        native = self._native_layers
        if native is not None and native.takes(hidden, meta, self.linears):
            return native(hidden, rope, meta)
        return self._eager_layers(hidden, rope, meta)

    def _mlp(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer_idx`'s MLP output (N, H) through its current linears."""
        lin = self.linears[layer_idx]
        return lin.down(self.mlp_act[layer_idx](x, lin.gate, lin.up, lin.gate_up))

    def _attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Layer `layer_idx`'s attention block output (N, H), K/V stored in the cache."""
        n = x.shape[0]
        qkv = self.linears[layer_idx].qkv(x)  # (N, q + 2 * kv)
        q, k, v = self.rotary[layer_idx](qkv, *rope, meta)
        out = self.attention.attend(layer_idx, q, k, v, meta)  # (N, nh, hd)
        return self.linears[layer_idx].o_proj(out.view(n, -1))  # (N, H)

    def _compiled_layers(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every decoder layer through the one compiled graph (dense.py), weights as inputs."""
        from backends.torch import dense, ops

        cos, sin = rope
        with ops.forward_context(self.attention, meta):
            for index, weights in zip(self._layer_index, self._layer_weights, strict=True):
                hidden = dense.compiled_decoder_layer(
                    hidden, cos, sin, index, weights, self._layer_shape
                )
        return hidden

    def enable_compiled(self) -> None:
        """Route the dense part of every layer through dense.py's compiled graph.

        Registers this model's `Linear`s for `carousel::linear`, then compiles (logged) for
        one token and for a dynamic token count, so no request waits for the compiler.
        NOTE: the graph calls the `Linear`s registered here, so a model whose `self.linears`
        are replaced later (tensor parallelism's row-parallel ones) must stay eager.
        """
        # NOTE: imported only here: importing them imports Dynamo and Inductor, whose threads
        # an eager server must not carry (backends/torch/device_thread.py)
        from backends.torch import dense

        inductor.configure()
        # the graph calls gate and up one by one (dense.py): their own packed copies
        self.linears = [
            _LayerLinears.of(layer, fuse_layer(layer), self._plan) for layer in self.layers
        ]
        for layer in self.layers:  # its packed copy is not used by the graph: not kept for it
            forget_gate_up(layer.mlp)
        self.native_layers = None  # it holds those copies too
        self._layer_index = [torch.tensor(i) for i in range(len(self.layers))]
        self._layer_weights = [self._weights_of(i) for i in range(len(self.layers))]
        spec = self.specs[0]
        eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self._layer_shape = dense.LayerShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, eps)
        self.compiled = True
        self._choose_layers()
        began = time.monotonic()
        inductor.log.info("compiling the decoder layer (torch.compile, Inductor)")
        try:
            for num_tokens in (1, 2):
                self._warm_up(num_tokens)
        except Exception:  # a compiler failure must not keep the server from starting
            inductor.log.exception("compiling the decoder layer failed; running it eager")
            self.compiled = False
            self._choose_layers()
            return
        inductor.log.info("decoder layer compiled", seconds=round(time.monotonic() - began, 1))

    def _weights_of(self, index: int) -> tuple[torch.Tensor | None, ...]:
        from backends.torch import ops

        lin, layer = self.linears[index], self.layers[index]
        for linear in (lin.qkv, lin.o_proj, lin.gate, lin.up, lin.down):
            assert isinstance(linear, Linear), "--compile runs no quantised linears (config.py)"
            ops.register_linear(linear)
        attn = layer.self_attn
        q_norm = attn.q_norm.weight if hasattr(attn, "q_norm") else None
        k_norm = attn.k_norm.weight if hasattr(attn, "k_norm") else None
        return (
            lin.qkv.weight, lin.qkv.bias, lin.o_proj.weight, lin.gate.weight, lin.up.weight,
            lin.down.weight, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            q_norm, k_norm,
        )  # fmt: skip

    @torch.inference_mode()
    def _warm_up(self, num_tokens: int) -> None:
        """One compiled forward over `num_tokens` fresh tokens, written to the first blocks
        (before the first request: nobody holds them yet, see `inputs.warm_up_layout`)."""
        device = self.kv_cache.k[0].device
        batch_layout = inputs.warm_up_layout(num_tokens, self.kv_cache.block_size, device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        self.forward(ids, positions, batch_layout)
