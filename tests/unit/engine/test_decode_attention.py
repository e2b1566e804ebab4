"""The C paged decode-attention kernel against the torch path it replaces."""
from __future__ import annotations

import pytest
import torch

from services.engine.attention import _decode, build_metadata


def scattered_decodes(ctx_lens: list[int], block_size: int, num_blocks: int):
    """One decode row per context length, each over blocks spread across the cache."""
    spans = []
    for i, ctx in enumerate(ctx_lens):
        table = [(i * 7 + j * 5) % num_blocks for j in range(-(-ctx // block_size))]
        spans.append((ctx - 1, 1, table))
    return build_metadata(spans, block_size, "cpu")


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("ctx_lens", [[2], [1 + 16], [5, 17, 100, 33], [16, 32, 8, 9, 200, 3]])
def test_kernel_matches_torch(lib, head_dim, ctx_lens):
    g = torch.Generator().manual_seed(len(ctx_lens) * head_dim)
    bs, nblk, hkv, group = 16, 64, 3, 3
    cache_k = torch.randn(nblk, bs, hkv, head_dim, generator=g)
    cache_v = torch.randn(nblk, bs, hkv, head_dim, generator=g)
    meta = scattered_decodes(ctx_lens, bs, nblk)
    q = torch.randn(len(ctx_lens), hkv * group, head_dim, generator=g) * 3  # peaky softmax too
    fast = _decode(q, cache_k, cache_v, meta, head_dim ** -0.5, group, lib)
    ref = _decode(q, cache_k, cache_v, meta, head_dim ** -0.5, group, None)
    assert fast.shape == ref.shape
    assert torch.allclose(fast, ref, atol=2e-5, rtol=1e-4)


def test_rows_ignore_padding_beyond_their_context(lib):
    """A short sequence batched with a long one reads only its own positions."""
    g = torch.Generator().manual_seed(1)
    cache_k = torch.randn(32, 8, 1, 64, generator=g)  # [blocks, block_size, Hkv, D]
    cache_v = torch.randn(32, 8, 1, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    both = _decode(q, cache_k, cache_v, scattered_decodes([3, 90], 8, 32), 0.125, 2, lib)
    alone = _decode(q[:1], cache_k, cache_v, scattered_decodes([3], 8, 32), 0.125, 2, lib)
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize("ctx_lens", [[2], [5, 17, 100, 33]])
def test_float16_cache_kernel_matches_torch_on_the_same_cache(lib, ctx_lens):
    """K/V stored as float16 (--kv-cache-dtype float16): the kernel converts as it loads and
    equals torch attending over the same float16 values."""
    g = torch.Generator().manual_seed(7)
    bs, nblk, hkv, group, d = 16, 64, 3, 3, 64
    cache_k = torch.randn(nblk, bs, hkv, d, generator=g).half()
    cache_v = torch.randn(nblk, bs, hkv, d, generator=g).half()
    meta = scattered_decodes(ctx_lens, bs, nblk)
    q = torch.randn(len(ctx_lens), hkv * group, d, generator=g) * 3
    fast = _decode(q, cache_k, cache_v, meta, d ** -0.5, group, lib)
    ref = _decode(q, cache_k.float(), cache_v.float(), meta, d ** -0.5, group, None)
    assert fast.dtype == torch.float32
    assert torch.allclose(fast, ref, atol=2e-5, rtol=1e-4)


def test_short_prompt_chunks_attend_through_the_kernel_as_through_torch(lib):
    """A step with fresh prompts, a continuation and a prompt too long for the kernel, then a
    decode: paged_prompts gives each prompt row the attention torch's causal kernel gives it."""
    from services.engine.attention import PAGED_PROMPT_MAX_CTX, attend, write_kv

    g = torch.Generator().manual_seed(3)
    bs, nblk, hkv, group, d = 16, 64, 3, 3, 64
    long_len = PAGED_PROMPT_MAX_CTX + 20
    spans = [(0, 9, [3, 4]), (0, 9, [5, 6]), (20, 11, [7, 8, 9]), (0, long_len, list(range(10, 28))),
             (0, 5, [30]), (40, 1, [31, 32, 33])]
    t = sum(n for _, n, _ in spans)
    cache_k = torch.zeros(nblk, bs, hkv, d)
    cache_v = torch.zeros(nblk, bs, hkv, d)
    for start, _, table in spans:  # cached context before each chunk
        for p in range(start):
            cache_k[table[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
            cache_v[table[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
    q = torch.randn(t, hkv * group, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    outs = []
    for paged in (True, False):
        meta = build_metadata(spans, bs, "cpu", paged_prompts=paged)
        write_kv(cache_k, cache_v, k, v, meta.slots)
        outs.append(attend(q, k, v, cache_k, cache_v, meta, d ** -0.5, lib))
        if paged:
            assert [s.paged for s in meta.prefills] == [True, True, True, False, True]
            assert [(r.start, r.end) for r in meta.paged_prompts] == [(0, 29), (29 + long_len, 34 + long_len)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_kernel_reads_queries_in_place_and_writes_into_out(lib, cache_dtype):
    """The query heads of a step's Q/K/V rows (a strided view) give the bits a contiguous copy
    gives, and `out` is filled where it lies (no copies either way)."""
    from services.engine import cpu_kernels

    g = torch.Generator().manual_seed(9)
    bs, nblk, hkv, group, d = 16, 64, 3, 3, 64
    cache_k = torch.randn(nblk, bs, hkv, d, generator=g).to(cache_dtype)
    cache_v = torch.randn(nblk, bs, hkv, d, generator=g).to(cache_dtype)
    meta = scattered_decodes([5, 17, 100, 33], bs, nblk)
    qkv = torch.randn(4, (hkv * group + 2 * hkv) * d, generator=g)
    q = qkv[:, :hkv * group * d].view(4, hkv * group, d)
    assert not q.is_contiguous()
    ref = cpu_kernels.paged_decode_attention(lib, q.contiguous(), cache_k, cache_v, meta.decode_blocks,
                                             meta.decode_ctx, 0.125)
    staging = torch.full((6, hkv * group, d), 7.0)
    got = cpu_kernels.paged_decode_attention(lib, q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx,
                                             0.125, out=staging[1:5])
    assert torch.equal(got, ref) and torch.equal(staging[1:5], ref)
    assert (staging[0] == 7).all() and (staging[5] == 7).all()
