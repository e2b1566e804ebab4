"""The C paged decode-attention kernel against the torch path it replaces."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.engine.attention import _decode, build_metadata


@pytest.fixture(params=["avx2", "avx512"])
def decode_isa(request, lib):
    """paged_decode_attention's kernel for the test: the AVX2 one, or the AVX-512 one where the
    CPU has AVX512F (the dispatcher takes it there unless TOKENSERVE_CPU_ISA caps it)."""
    if request.param == "avx512" and not lib.avx512_allowed:
        pytest.skip("the CPU (or TOKENSERVE_CPU_ISA) has no AVX512F: decode attention runs on AVX2")
    lib.fused_allow_avx512(int(request.param == "avx512"))
    yield request.param
    lib.fused_allow_avx512(int(lib.avx512_allowed))


def scattered_decodes(ctx_lens: list[int], block_size: int, num_blocks: int):
    """One decode row per context length, each over blocks spread across the cache."""
    spans = []
    for i, ctx in enumerate(ctx_lens):
        table = [(i * 7 + j * 5) % num_blocks for j in range(-(-ctx // block_size))]
        spans.append((ctx - 1, 1, table))
    return build_metadata(spans, block_size, "cpu")


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("ctx_lens", [[2], [1 + 16], [5, 17, 100, 33], [16, 32, 8, 9, 200, 3]])
def test_kernel_matches_torch(lib, decode_isa, head_dim, ctx_lens):
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


def test_rows_ignore_padding_beyond_their_context(lib, decode_isa):
    """A short sequence batched with a long one reads only its own positions."""
    g = torch.Generator().manual_seed(1)
    cache_k = torch.randn(32, 8, 1, 64, generator=g)  # [blocks, block_size, Hkv, D]
    cache_v = torch.randn(32, 8, 1, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    both = _decode(q, cache_k, cache_v, scattered_decodes([3, 90], 8, 32), 0.125, 2, lib)
    alone = _decode(q[:1], cache_k, cache_v, scattered_decodes([3], 8, 32), 0.125, 2, lib)
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize("ctx_lens", [[2], [5, 17, 100, 33]])
def test_float16_cache_kernel_matches_torch_on_the_same_cache(lib, decode_isa, ctx_lens):
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
def test_kernel_reads_queries_in_place_and_writes_into_out(lib, decode_isa, cache_dtype):
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


def _kernel_call(fn, q, cache_k, cache_v, meta):
    out = torch.empty(q.shape)
    fn(q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), meta.decode_blocks.data_ptr(),
       meta.decode_ctx.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], cache_k.shape[2], q.shape[2],
       cache_k.shape[1], meta.decode_blocks.shape[1], 0.125, q.shape[1] * q.shape[2])
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_cpu_picks_the_avx512_kernel_where_it_may_and_the_avx2_one_otherwise(lib, cache_dtype):
    """Where AVX512F is allowed, a head_dim that is a multiple of 16 goes through the AVX-512
    kernel (its own sums, a few last bits off the AVX2 kernel's); capped, or at head_dim 72,
    through the AVX2 one."""
    from services.engine import cpu_kernels

    if not lib.avx512_allowed:
        pytest.skip("the CPU (or TOKENSERVE_CPU_ISA) has no AVX512F: decode attention runs on AVX2")
    suffix = "_f16" if cache_dtype == torch.float16 else ""
    avx2 = getattr(lib, f"paged_decode_attention{suffix}_avx2")
    avx512 = getattr(lib, f"paged_decode_attention{suffix}_avx512")
    meta = scattered_decodes([5, 17, 100, 33, 250], 16, 64)
    try:
        for d, wide in ((64, True), (128, True), (72, False)):
            g = torch.Generator().manual_seed(d)
            cache_k = torch.randn(64, 16, 3, d, generator=g).to(cache_dtype)
            cache_v = torch.randn(64, 16, 3, d, generator=g).to(cache_dtype)
            q = torch.randn(5, 9, d, generator=g) * 3
            by_avx2, by_avx512 = (_kernel_call(fn, q, cache_k, cache_v, meta) for fn in (avx2, avx512))
            for allow in (1, 0):
                lib.fused_allow_avx512(allow)
                got = cpu_kernels.paged_decode_attention(lib, q, cache_k, cache_v, meta.decode_blocks,
                                                         meta.decode_ctx, 0.125)
                assert torch.equal(got, by_avx512 if allow and wide else by_avx2), (d, allow)
            if wide:
                assert not torch.equal(by_avx512, by_avx2)  # the sums' order differs: a few last bits
                torch.testing.assert_close(by_avx512, by_avx2, atol=2e-6, rtol=1e-5)
    finally:
        lib.fused_allow_avx512(int(lib.avx512_allowed))


def test_a_cap_below_avx512_keeps_decode_attention_on_avx2():
    """TOKENSERVE_CPU_ISA=avx2 on an AVX-512 CPU: the loader forbids the AVX-512 kernel, so the
    engine computes what an AVX2-only CPU computes."""
    code = """
import torch
from services.engine import cpu_kernels
from services.engine.attention import build_metadata
lib = cpu_kernels.load()
meta = build_metadata([(39, 1, [2, 5, 9])], 16, "cpu")
g = torch.Generator().manual_seed(1)
ck, cv = torch.randn(16, 16, 3, 64, generator=g).half(), torch.randn(16, 16, 3, 64, generator=g).half()
q = torch.randn(1, 9, 64, generator=g)
got = cpu_kernels.paged_decode_attention(lib, q, ck, cv, meta.decode_blocks, meta.decode_ctx, 0.125)
ref = torch.empty(1, 9, 64)
lib.paged_decode_attention_f16_avx2(q.data_ptr(), ck.data_ptr(), cv.data_ptr(), meta.decode_blocks.data_ptr(),
    meta.decode_ctx.data_ptr(), ref.data_ptr(), 1, 9, 3, 64, 16, meta.decode_blocks.shape[1], 0.125, 9 * 64)
print(lib.avx512_allowed, torch.equal(got, ref))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENSERVE_CPU_ISA": "avx2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "True"]


# -- prompt rows a block at a time (cpu_kernels.prompt_attention, AVX-512) -------------------
@pytest.fixture
def avx512lib(lib):
    if not lib.avx512_allowed:
        pytest.skip("the CPU (or TOKENSERVE_CPU_ISA) has no AVX512F: prompt rows go row by row")
    return lib


def _prompt_step(g, spans, bs, nblk, hkv, group, d, cache_dtype):
    """The cache holding each chunk's cached context, and a step's q/k/v for the chunks."""
    cache_k = torch.zeros(nblk, bs, hkv, d)
    cache_v = torch.zeros(nblk, bs, hkv, d)
    for start, _, table in spans:
        for p in range(start):
            cache_k[table[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
            cache_v[table[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
    t = sum(n for _, n, _ in spans)
    q = torch.randn(t, hkv * group, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    return cache_k.to(cache_dtype), cache_v.to(cache_dtype), q, k, v


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv, group, d", [(3, 3, 64), (1, 8, 128), (4, 1, 32), (2, 48, 64), (1, 5, 64)])
def test_prompt_rows_a_block_at_a_time_get_the_attention_torch_gives_them(avx512lib, cache_dtype, hkv, group, d):
    """Fresh prompts of 1 to 70 tokens, a continuation of a cached context, a chunk of one
    token: each prompt row gets causal attention over the cache's K/V up to its position."""
    from services.engine import cpu_kernels
    from services.engine.attention import attend, write_kv

    g = torch.Generator().manual_seed(5)
    bs, nblk = 16, 64
    spans = [(0, 70, [3, 4, 5, 6, 7]), (0, 1, [8]), (37, 20, [9, 10, 11, 12]), (0, 17, [13, 14]),
             (5, 1, [15])]
    cache_k, cache_v, q, k, v = _prompt_step(g, spans, bs, nblk, hkv, group, d, cache_dtype)
    meta = build_metadata(spans, bs, "cpu", paged_prompts=True)
    write_kv(cache_k, cache_v, k, v, meta.slots)
    assert all(s.paged for s in meta.prefills) and cpu_kernels.prompt_attention_fits(
        avx512lib, hkv * group, hkv, d, cache_dtype)
    got = attend(q, k, v, cache_k, cache_v, meta, d ** -0.5, avx512lib)
    # torch, on the same cached (possibly float16) K/V
    want = torch.empty_like(got).view(q.shape)
    row = 0
    for start, n, table in spans:
        ctx = start + n
        ks = torch.stack([cache_k[table[p // bs], p % bs] for p in range(ctx)]).float()
        vs = torch.stack([cache_v[table[p // bs], p % bs] for p in range(ctx)]).float()
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[row:row + n].transpose(0, 1), ks.transpose(0, 1).repeat_interleave(group, 0),
            vs.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask, scale=d ** -0.5)
        want[row:row + n] = o.transpose(0, 1)
        row += n
    torch.testing.assert_close(got, want.view(got.shape), atol=2e-5, rtol=1e-4)


def test_a_prompt_rows_attention_does_not_depend_on_how_its_chunk_is_cut_or_batched(avx512lib):
    """The same prompt rows, alone, in one chunk, cut into chunks of other sizes or beside
    other prompts: bit for bit the same results (the rows of a block never mix)."""
    from services.engine import cpu_kernels
    from services.engine.attention import write_kv

    g = torch.Generator().manual_seed(8)
    bs, hkv, group, d, n = 16, 3, 3, 64, 53
    table = [2, 7, 4, 9]
    cache_k = torch.zeros(16, bs, hkv, d, dtype=torch.float16)
    cache_v = torch.zeros(16, bs, hkv, d, dtype=torch.float16)
    q = torch.randn(n, hkv * group, d, generator=g)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    write_kv(cache_k, cache_v, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), slots)

    def run(cuts):
        """the rows [a, b) of each cut as one chunk; every chunk in one call"""
        tables = torch.tensor([table] * n)
        ctx = torch.arange(1, n + 1)
        chunks = torch.tensor([(a, b - a) for a, b in cuts])
        out = torch.empty(n, hkv * group, d)
        return cpu_kernels.prompt_attention(avx512lib, q, cache_k, cache_v, tables, ctx, chunks, 0.125, out)

    whole = run([(0, n)])
    for cuts in ([(0, 1), (1, n)], [(0, 20), (20, 21), (21, 53)], [(i, i + 1) for i in range(n)],
                 [(0, 17), (17, 40), (40, 53)]):
        assert torch.equal(run(cuts), whole), cuts
    # one row alone (its own call)
    for r in (0, 16, 52):
        out = torch.empty(1, hkv * group, d)
        one = cpu_kernels.prompt_attention(avx512lib, q[r:r + 1], cache_k, cache_v, torch.tensor([table]),
                                           torch.tensor([r + 1]), torch.tensor([(0, 1)]), 0.125, out)
        assert torch.equal(one[0], whole[r])


def test_without_avx512_prompt_rows_go_row_by_row_through_the_decode_kernel(lib, monkeypatch):
    """Where prompt_attention does not serve (an AVX2-only CPU, or TOKENSERVE_CPU_ISA=avx2 at
    load), attend takes the decode kernel for the same rows, with the same results."""
    from services.engine import cpu_kernels, isa
    from services.engine.attention import attend, write_kv

    g = torch.Generator().manual_seed(4)
    bs, hkv, group, d = 16, 3, 3, 64
    spans = [(0, 33, [1, 2, 3]), (10, 6, [4])]
    cache_k, cache_v, q, k, v = _prompt_step(g, spans, bs, 8, hkv, group, d, torch.float16)
    meta = build_metadata(spans, bs, "cpu", paged_prompts=True)
    write_kv(cache_k, cache_v, k, v, meta.slots)
    calls = []
    real = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(lib, "avx512_allowed", False)
    rowwise = attend(q, k, v, cache_k, cache_v, meta, 0.125, lib)
    assert calls == [1]
    if "avx512f" in isa.hardware_flags():  # the CPU can run both: they agree
        monkeypatch.setattr(lib, "avx512_allowed", True)
        blocked = attend(q, k, v, cache_k, cache_v, meta, 0.125, lib)
        assert calls == [1]
        torch.testing.assert_close(blocked, rowwise, atol=2e-6, rtol=1e-5)
