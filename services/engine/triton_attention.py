"""Paged decode attention in Triton: each decode row reads only its own KV blocks, through its
block table, in place (no gather of the padded cache), with an online softmax.

    out = paged_decode_attention(q, cache_k, cache_v, block_tables, ctx_lens, scale)
    # q: [B, H, D]; cache_k/v: [num_blocks, block_size, Hkv, D]; block_tables: [B, W] (int);
    # ctx_lens: [B] (int, >= 1): row b attends to positions [0, ctx_lens[b]) -> out [B, H, D]

One program per (row, KV head) computes all of that head's query heads together (grouped-query
attention: the K/V tile is read once for the group), the group padded to 16 rows so both
products are tensor-core dots. The loop over the context reads TILE positions at a time, each
position's block looked up in the table, and runs up to the row's own length, read on the
device: the launch depends on nothing but shapes, so a CUDA graph can capture it and replay
it for any lengths. Block tables may be wider than a row needs (stale columns are never read).

Used by the model for decode rows on CUDA (attention.attend's `paged`); attention._decode's
gather path stays the reference it is tested against (tests/unit/engine/test_triton_attention.py
runs this kernel on the CPU in Triton's interpreter, TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions per loop iteration (several blocks of a table when block_size is smaller).
TILE = 64
# tl.dot needs at least 16 rows: a KV head's query heads are padded to this.
MIN_GROUP_ROWS = 16


@triton.jit
def _paged_decode_kernel(Q, K, V, TABLES, CTX, OUT, scale,
                         stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                         F32_DOT: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(CTX + row).to(tl.int32)
    g = tl.arange(0, GROUP_ROWS)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G, D]
    if F32_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)
    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)  # running max
    l = tl.zeros([GROUP_ROWS], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_ROWS, D_PAD], tl.float32)
    for start in range(0, ctx, TILE_N):
        t = start + tl.arange(0, TILE_N)
        tmask = t < ctx
        blk = tl.load(TABLES + row * stride_tb + t // BLOCK_SIZE, mask=tmask, other=0)
        off = blk.to(tl.int64) * stride_kb + (t % BLOCK_SIZE) * stride_kt + kvh * stride_kh  # [TILE]
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(K + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE, D]
        if F32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [G, TILE] float32
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf; ctx >= 1 so m_new is finite)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE, D]
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l[:, None]
    tl.store(OUT + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def launch_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """The kernel's compile-time sizes for a model's heads."""
    group = num_heads // num_kv_heads
    return {"GROUP": group,
            "GROUP_ROWS": max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
            "HEAD_DIM": head_dim, "D_PAD": max(16, triton.next_power_of_2(head_dim))}


def paged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """See the module docstring. With a float32 query or cache both products are full float32
    ("ieee", not TF32); 16-bit ones run on tensor cores in the cache's dtype with float32
    accumulation."""
    b, h, d = q.shape
    _, block_size, hkv, _ = cache_k.shape
    if cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("cache_k and cache_v must share one contiguous layout")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    ctx_lens = ctx_lens.contiguous()
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    shape = launch_shape(h, hkv, d)
    _paged_decode_kernel[(b, hkv)](
        q, cache_k, cache_v, block_tables, ctx_lens, out, scale,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, TILE_N=TILE,
        F32_DOT=torch.float32 in (q.dtype, cache_k.dtype), **shape)
    return out
