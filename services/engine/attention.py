"""Paged KV cache and attention over any mix of prefill and decode chunks.

Cache layout per layer: K and V each [num_blocks, block_size, n_kv_heads, head_dim]. Position
p of a sequence lives in block block_table[p // block_size] at offset p % block_size; its
flat slot is block * block_size + offset. Attention reads only a sequence's own blocks.

Token order inside a step (the runner builds it): all prefill chunks first, then all decode
chunks, so decodes are one contiguous run [decode_start, T). A decode chunk is one token, or
a speculative one: its last token plus drafts, each row a decode query of its own that sees
the cache up to its position (every token's K/V is written before attention runs).

Decode rows go, in order of preference: a `paged` kernel given by the model (on CUDA the
Triton kernel of triton_attention.py, which reads each row's blocks through its block table),
the C kernel on the CPU, else torch over a gather of the rows' blocks padded to the longest
(the reference path). On the CPU, prompt chunks whose whole context is short go through the
C kernels too (`paged_prompts`): a call of torch's flash kernel costs more than its work at
these sizes (a 64-token prompt: 89 instead of 200 us a layer; 256: 1.2 vs 1.4 ms). Where the
CPU has AVX-512 that is cpu_kernels.prompt_attention, a block of a chunk's rows at a time
(16 prompts of 64 tokens, 30 layers, 2-core Xeon: 49 -> 27 ms), for chunks up to
BLOCKED_PROMPT_MAX_CTX; else the decode kernel, row by row, up to PAGED_PROMPT_MAX_CTX.
Either way a prompt row attends the cache's K/V (float16 by default), as its decode rows will.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.device import to_device


# (q [B, H, D], cache_k, cache_v, block_tables [B, W], ctx_lens [B], scale) -> [B, H, D]
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                       torch.Tensor]


class KVCache:
    """Pre-allocated paged K/V tensors for every layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str):
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, n_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * n_kv_heads * head_dim * dtype.itemsize


# Prompt chunks whose context ends within this many positions attend through the paged
# decode kernel, one query row each (when the caller asks for it: `build_metadata`).
PAGED_PROMPT_MAX_CTX = 256
# ... and through cpu_kernels.prompt_attention where it serves (AVX-512), a chunk's rows at a
# time: faster than torch's flash kernel at every length measured (float16 cache, 9 heads of
# 64, a layer on 2 cores: 256 tokens 0.58 vs 1.25 ms, 1,024: 8.1 vs 11.2, 2,048: 28 vs 41);
# bounded so a thread's scratch stays a few MB
BLOCKED_PROMPT_MAX_CTX = 4096


@dataclass
class PrefillSpan:
    """One multi-token chunk: queries are tokens [q_start, q_start + q_len) of the step,
    at positions [start_pos, start_pos + q_len)."""

    q_start: int
    q_len: int
    start_pos: int
    # Blocks covering [0, start_pos + q_len); only read when start_pos > 0.
    blocks: list[int]
    # Attends in a PagedRows run (row by row through the decode kernel), not here.
    paged: bool = False


@dataclass
class PagedRows:
    """Consecutive prompt rows [start, end) that attend as decode rows: row i sees the cache
    up to and including its own position (its K/V are written before attention runs)."""

    start: int
    end: int
    blocks: torch.Tensor  # [end - start, max_blocks] block tables (padded with block 0)
    ctx: torch.Tensor  # [end - start] context lengths (int64)
    # [chunks, 2] (first row from start, rows): each chunk's rows (cpu_kernels.prompt_attention)
    chunks: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    # Flat cache slot of every token of the step: [T].
    slots: torch.Tensor
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Decode tokens are rows [decode_start, T).
    decode_start: int = 0
    # [B, max_blocks] block tables of the decode rows (padded with block 0).
    decode_blocks: torch.Tensor | None = None
    # [B] context length of each decode row (int64).
    decode_ctx: torch.Tensor | None = None
    # Single decode row whose blocks are consecutive: (first block, context length); read as a view.
    decode_contiguous: tuple[int, int] | None = None
    # Runs of short prompt chunks that attend through the decode kernel (paged_prompts).
    paged_prompts: list[PagedRows] = field(default_factory=list)


def build_metadata(spans: list[tuple], block_size: int, device: str, paged_prompts: bool = False,
                   paged_max_ctx: int = PAGED_PROMPT_MAX_CTX) -> AttentionMetadata:
    """spans: per chunk (start_pos, num_new_tokens, block_table[, decode rows]), prefills
    before decodes. A chunk is decoded row by row when the optional 4th item is True (a
    speculative chunk), or when it is one token after a cached context. paged_prompts: prompt
    chunks whose context ends within paged_max_ctx attend through the CPU kernels too (the
    caller has them for its cache: PAGED_PROMPT_MAX_CTX for the decode kernel,
    BLOCKED_PROMPT_MAX_CTX where cpu_kernels.prompt_attention serves)."""
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
    decodes: list[tuple[int, list[int]]] = []
    q_start = 0
    for span in spans:
        start_pos, n, table = span[:3]
        for p in range(start_pos, start_pos + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
        if (span[3] if len(span) > 3 else n == 1) and start_pos > 0:
            decodes.extend((p + 1, table) for p in range(start_pos, start_pos + n))
        else:
            if decodes:
                raise ValueError("prefill chunks must come before decode chunks")
            prefills.append(PrefillSpan(q_start, n, start_pos, table))
        q_start += n
    meta = AttentionMetadata(slots=to_device(slots, torch.long, device),
                             prefills=prefills, decode_start=q_start - len(decodes))
    if paged_prompts:
        meta.paged_prompts = _paged_prompt_runs(prefills, block_size, paged_max_ctx)
    if decodes:
        nb = max(-(-ctx // block_size) for ctx, _ in decodes)
        tables = [t[:nb] + [0] * (nb - min(nb, len(t))) for _, t in decodes]
        meta.decode_blocks = to_device(tables, torch.long, device)
        meta.decode_ctx = to_device([ctx for ctx, _ in decodes], torch.long, device)
    if len(decodes) == 1 and _consecutive(decodes[0][1], decodes[0][0], block_size):
        ctx, table = decodes[0]
        meta.decode_contiguous = (table[0], ctx)
    return meta


def _paged_prompt_runs(prefills: list[PrefillSpan], block_size: int, max_ctx: int) -> list[PagedRows]:
    """Marks the short prompt chunks `paged` and groups consecutive ones into runs (CPU)."""
    runs: list[list[PrefillSpan]] = []
    for span in prefills:
        if span.start_pos + span.q_len > max_ctx:
            continue
        span.paged = True
        if runs and runs[-1][-1].q_start + runs[-1][-1].q_len == span.q_start:
            runs[-1].append(span)
        else:
            runs.append([span])
    out = []
    for run in runs:
        nb = max(-(-(s.start_pos + s.q_len) // block_size) for s in run)
        tables = torch.tensor([s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in run])
        counts = torch.tensor([s.q_len for s in run])
        ctx = torch.cat([torch.arange(s.start_pos + 1, s.start_pos + s.q_len + 1) for s in run])
        chunks = torch.tensor([(s.q_start - run[0].q_start, s.q_len) for s in run])
        out.append(PagedRows(run[0].q_start, run[-1].q_start + run[-1].q_len,
                             tables.repeat_interleave(counts, dim=0), ctx, chunks))
    return out


def _consecutive(table: list[int], ctx: int, block_size: int) -> bool:
    nb = -(-ctx // block_size)
    return all(table[i] == table[0] + i for i in range(1, nb))


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> their slots in the paged cache."""
    hkv, d = k.shape[1], k.shape[2]
    cache_k.view(-1, hkv, d).index_copy_(0, slots, k.to(cache_k.dtype))
    cache_v.view(-1, hkv, d).index_copy_(0, slots, v.to(cache_v.dtype))


def _read(cache: torch.Tensor, blocks: list[int], ctx: int) -> torch.Tensor:
    """A sequence's first ctx cached positions: [ctx, Hkv, D] (a view when blocks are consecutive)."""
    bs = cache.shape[1]
    nb = -(-ctx // bs)
    if _consecutive(blocks, ctx, bs):
        kv = cache[blocks[0]:blocks[0] + nb]
    else:
        kv = cache[to_device(blocks[:nb], torch.long, cache.device)]
    return kv.flatten(0, 1)[:ctx]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
           cache_v: torch.Tensor, meta: AttentionMetadata, scale: float,
           kernels: ctypes.CDLL | None = None, paged: PagedDecode | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (already written to the cache) -> [T, H * D].
    The cache may hold a narrower dtype than q (e.g. float16 K/V for float32 compute).
    kernels: the cpu_kernels library (float32 queries, float32 or float16 CPU caches) for the
    decode rows, else torch. paged: a kernel for the decode rows that reads the cache through
    the block tables (first choice when given)."""
    t, h, d = q.shape
    group = h // k.shape[1]
    if not meta.prefills:  # decode-only step: no staging buffer
        return _decode(q, cache_k, cache_v, meta, scale, group, kernels, paged).view(t, h * d)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    blocked = bool(meta.paged_prompts) and cpu_kernels.prompt_attention_fits(
        kernels, h, k.shape[1], d, cache_k.dtype)
    for run in meta.paged_prompts:
        if blocked:
            cpu_kernels.prompt_attention(kernels, q[run.start:run.end], cache_k, cache_v, run.blocks, run.ctx,
                                         run.chunks, scale, out=out[run.start:run.end])
        else:
            cpu_kernels.paged_decode_attention(kernels, q[run.start:run.end], cache_k, cache_v, run.blocks,
                                               run.ctx, scale, out=out[run.start:run.end])
    for span in meta.prefills:
        if span.paged:
            continue
        rows = slice(span.q_start, span.q_start + span.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if span.start_pos == 0:
            ks, vs, mask = k[rows], v[rows], None  # [q, Hkv, D]
        else:
            ctx = span.start_pos + span.q_len
            ks = _read(cache_k, span.blocks, ctx).to(q.dtype)  # [ctx, Hkv, D]
            vs = _read(cache_v, span.blocks, ctx).to(q.dtype)
            qpos = torch.arange(span.start_pos, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [q, ctx]
        # 4-D inputs with K/V repeated per query head: torch's CPU flash kernel is several
        # times faster this way than with 3-D inputs or enable_gqa.
        ks = ks.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)  # [1, H, ctx, D]
        vs = vs.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                           scale=scale)
        out[rows] = o[0].transpose(0, 1)
    start = meta.decode_start
    if start < t:
        out[start:] = _decode(q[start:], cache_k, cache_v, meta, scale, group, kernels, paged)
    return out.view(t, h * d)


def kernel_fits(kernels: ctypes.CDLL | None, head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the CPU decode kernel serves this cache (the C kernels loaded, float32 or
    float16 K/V, head_dim a multiple of 8)."""
    return kernels is not None and head_dim % 8 == 0 and cache_dtype in (torch.float32, torch.float16)


def _decode(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, meta: AttentionMetadata,
            scale: float, group: int, kernels: ctypes.CDLL | None,
            paged: PagedDecode | None = None) -> torch.Tensor:
    """One query per row. q: [B, H, D] -> [B, H, D]. Plain matmuls beat the flash kernel here."""
    b, h, d = q.shape
    if paged is not None:
        return paged(q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx, scale)
    if kernel_fits(kernels, d, cache_k.dtype):
        # Reads each sequence's blocks in place: no padded gather, no per-layer copies.
        return cpu_kernels.paged_decode_attention(kernels, q, cache_k, cache_v, meta.decode_blocks,
                                                  meta.decode_ctx, scale)
    qd = q.view(b, h // group, group, d)  # [B, Hkv, G, D]
    if meta.decode_contiguous is not None:
        first, ctx = meta.decode_contiguous
        nb = -(-ctx // cache_k.shape[1])
        ks = cache_k[first:first + nb].flatten(0, 1)[:ctx].unsqueeze(0).to(q.dtype)  # [1, L, Hkv, D]
        vs = cache_v[first:first + nb].flatten(0, 1)[:ctx].unsqueeze(0).to(q.dtype)
        mask = None
    else:
        ks = cache_k[meta.decode_blocks].flatten(1, 2).to(q.dtype)  # [B, L, Hkv, D]
        vs = cache_v[meta.decode_blocks].flatten(1, 2).to(q.dtype)
        # [B, 1, 1, L]: True where a key position is padding (>= the row's context length)
        pos = torch.arange(ks.shape[1], device=q.device)
        mask = (pos[None, :] >= meta.decode_ctx[:, None])[:, None, None, :]
    scores = torch.matmul(qd, ks.permute(0, 2, 3, 1)).mul_(scale)  # [B, Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vs.transpose(1, 2)).view(b, h, d)  # [B, Hkv, G, D]
