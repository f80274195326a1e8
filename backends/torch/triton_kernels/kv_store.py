# mypy: allow-untyped-defs
# (a @triton.jit kernel's annotations are Triton's: constexpr or a dtype, not Python types)
"""The K/V store kernel: this step's new K and V into the paged cache at `slot_mapping`.

One program per token copies all of its K/V heads to slot `slot_mapping[t]` (block
`slot // block_size`, offset `slot % block_size`) of the `[num_blocks, block_size, nkv, hd]`
caches. A negative slot is skipped: a padded row (a CUDA-graph bucket larger than the
batch) writes nothing. K and V may be strided views of the fused QKV projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # (HEADS_PAD, DIM_PAD)
    k = tl.load(
        k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    k_dst = block * stride_kc_block + offset * stride_kc_slot + heads[:, None] * stride_kc_head
    v_dst = block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head
    tl.store(k_cache_ptr + k_dst + dims[None, :], k, mask=mask)
    tl.store(v_cache_ptr + v_dst + dims[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `k`, `v` (N, nkv, hd) into the caches (num_blocks, bs, nkv, hd) at their slots.

    NOTE: the head dim must be unit-stride in every tensor (it is in every view the model
    makes); the token and head strides may be anything.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for t in (k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("store_kv needs a unit-stride head dim")
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip
