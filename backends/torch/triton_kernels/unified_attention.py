# mypy: allow-untyped-defs
# (a @triton.jit kernel's annotations are Triton's: constexpr or a dtype, not Python types)
"""One attention kernel for a whole mixed step: prefills, prefill chunks and decodes together.

The design is vLLM's unified Triton attention's (written anew here): the flat batch of
queries is cut into query blocks of `BLOCK_Q` tokens that never straddle two sequences, and
one program takes one query block against one K/V head. Its `BLOCK_M = BLOCK_Q * group` rows
are the block's tokens times the `group` query heads that share the K/V head (GQA packed into
the rows of one matrix), so every key and value tile is loaded once for all of them.

- Varlen queries: sequence `i` owns rows `[cu_seqlens_q[i], cu_seqlens_q[i + 1])` and query
  blocks `[cu_seqlens_q[i] // BLOCK_Q + i, ...)`; a program finds its sequence by binary
  search over `cu_seqlens_q`. The grid, `N // BLOCK_Q + B` query blocks, is an upper bound
  known on the host, so launching needs no device sync (and a CUDA graph can replay it);
  programs past their sequence's last block return at once.
- K/V are read in place: key position `p` of sequence `i` is slot `p % block_size` of block
  `block_tables[i, p // block_size]`. No gather, no padding to the longest context: each
  program walks only its own context, so one 8k-token sequence in a decode batch costs the
  other programs nothing.
- Causal and sliding-window masks are computed from positions inside the kernel (token `t`
  of a sequence with `seq_lens[i]` keys sits at `seq_lens[i] - q_len + t`); no mask tensor.
  Key tiles wholly outside the window or past the block's last query are never visited.
- Online softmax in fp32 (running max and sum per row); fp32 caches multiply in IEEE fp32,
  not TF32, so the fp32 path matches the reference. bf16/fp16 caches multiply in their own
  dtype with fp32 sums (tensor cores), except in Triton's interpreter (the CPU), whose bf16
  dot is wrong (triton 3.9): there every dot is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows of one program: tensor-core dots need at least 16
MIN_BLOCK_M = 16
#: keys per inner step
TILE = 32


@triton.jit
def _sequence_of(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include `q_block` (binary search over cu_seqlens_q)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr,  # (N, nh, hd)
    q_ptr,  # (N, nh, hd)
    k_cache_ptr,  # (num_blocks, block_size, nkv, hd)
    v_cache_ptr,
    block_tables_ptr,  # (B, max_blocks)
    seq_lens_ptr,  # (B,) keys of each sequence, this step's included
    cu_seqlens_q_ptr,  # (B + 1,)
    scale,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    stride_bt_block,
    GROUP: tl.constexpr,  # query heads per K/V head
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # HEAD_DIM to a power of two
    BLOCK_SIZE: tl.constexpr,  # the KV cache's
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, a power of two >= BLOCK_Q * GROUP
    TILE: tl.constexpr,  # keys per step
    WINDOW: tl.constexpr,  # sliding window in keys, 0 = none
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in fp32 whatever the dtype (the interpreter's bf16 dot is wrong)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _sequence_of(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's block within the sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # keys before this step's first token

    rows = tl.arange(0, BLOCK_M)
    token = local * BLOCK_Q + rows // GROUP  # (BLOCK_M,) token within the sequence's queries
    head = kv_head * GROUP + rows % GROUP  # (BLOCK_M,) query head
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, DIM_PAD)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = cached + token  # (BLOCK_M,) each row's own key position

    # keys this block can see: up to its last token, from its first token's window on
    last_token = tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_end = cached + last_token + 1
    key_start = 0
    if WINDOW > 0:
        key_start = tl.maximum(cached + local * BLOCK_Q - WINDOW + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    keys = tl.arange(0, TILE)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(key_start // TILE, tl.cdiv(key_end, TILE)):
        pos = tile * TILE + keys  # (TILE,) key positions
        key_ok = pos < key_end
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_block, mask=key_ok, other=0)
        block = block.to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_off = block * stride_kc_block + slot * stride_kc_slot + kv_head * stride_kc_head
        v_off = block * stride_vc_block + slot * stride_vc_slot + kv_head * stride_vc_head
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_M, TILE)
        allowed = row_ok[:, None] & key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_m_for(group: int, max_query_len: int) -> int:
    """Rows per program: 16 (a decode's group fits), more for long prefills' query blocks."""
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    if max_query_len > 1:
        block_m = max(block_m, min(64, triton.next_power_of_2(max_query_len * group)))
    return block_m


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
) -> None:
    """Attention of every query row of `q` (N, nh, hd) into `out` (N, nh, hd).

    `cu_seqlens_q` (B + 1,) cuts the rows into sequences; sequence `i` has `seq_lens[i]` keys
    (this step's included, already stored) in `block_tables[i]`. `max_query_len` (a host
    int) only picks the query block size.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for t in (q, out, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("paged_attention needs a unit-stride head dim")
    # NOTE: on the CPU these kernels run in Triton's interpreter, whose bf16 dot is wrong
    upcast = q.device.type == "cpu"
    block_m = block_m_for(group, max_query_len)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, TILE=TILE,
        WINDOW=sliding_window or 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
    )  # fmt: skip
