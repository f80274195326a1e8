"""Rotary on a layer's fused Q/K/V, then this step's K/V into the paged cache.

The reference rotates the Q and K heads in one go (Qwen3 first norms each head, as its
attention module does) and stores K/V through the backend's `write_kv`. Carousel's CPU
kernel does the rotary in place and writes K/V into the shared cache layout in one pass:
only for backends that store K/V as the base class does, with no per-head norm, even heads.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from backends.torch.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from backends.torch.layers.custom_op import CustomOp
from backends.torch.layers.layernorm import HeadNorms

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryWriteKV(CustomOp):
    """Layer `layer`'s (q, k, v) from its `qkv` (N, q + 2 * kv), rotary applied, K/V stored."""

    def __init__(
        self,
        layer: int,
        head_norms: HeadNorms | None,
        spec: AttentionSpec,
        backend: AttentionBackend[Any],
        device: torch.device,
        kernels: ModuleType | None,
    ) -> None:
        self.layer, self.spec, self.backend = layer, spec, backend
        #: the per-head RMSNorms of Q and K before rotary (Qwen3's), or None
        self.head_norms = head_norms
        self.q_size = spec.num_heads * spec.head_dim
        self.qk_size = (spec.num_heads + spec.num_kv_heads) * spec.head_dim
        super().__init__(device, kernels)

    def supports_kernels(self) -> bool:
        return (
            self.backend.shared_kv_write and self.head_norms is None and self.spec.head_dim % 2 == 0
        )

    def __call__(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> QKV:
        out: QKV = self._forward(qkv, cos, sin, meta)
        return out

    def _split(self, qkv: torch.Tensor) -> QKV:
        n, spec = qkv.shape[0], self.spec
        q = qkv[:, : self.q_size].view(n, spec.num_heads, spec.head_dim)  # (N, nh, hd)
        k = qkv[:, self.q_size : self.qk_size].view(n, spec.num_kv_heads, spec.head_dim)
        v = qkv[:, self.qk_size :].view(n, spec.num_kv_heads, spec.head_dim)  # (N, nkv, hd)
        return q, k, v

    def forward_native(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> QKV:
        """`cos` and `sin` are (N, 1, hd): they broadcast over the heads."""
        q, k, v = self._split(qkv)
        if self.head_norms is not None:  # Qwen3: RMSNorm per head
            q_norm, k_norm = self.head_norms
            q, k = q_norm.module(q), k_norm.module(k)
            q = q * cos + rotate_half(q) * sin  # (N, nh, hd)
            k = k * cos + rotate_half(k) * sin  # (N, nkv, hd)
        else:  # one rotary over the Q and K heads together
            n, spec = qkv.shape[0], self.spec
            qk = qkv[:, : self.qk_size].view(n, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
        self.backend.write_kv(self.layer, k, v, meta)
        return q, k, v

    def forward_cpu(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> QKV:
        assert self.kernels is not None
        cache, spec = self.backend.kv_cache, self.spec
        self.kernels.rotary_write_kv(
            qkv, cos[:, 0], sin[:, 0], cache.k[self.layer], cache.v[self.layer],
            meta.layout.slot_mapping, spec.num_heads, spec.num_kv_heads,
        )  # fmt: skip
        return self._split(qkv)
