"""The GGUF block kernels (kernels/gguf_linear.c), once per instruction-set build this CPU runs,
and the engine's default mode serving a GGUF file's own blocks."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from services.engine import cpu_kernels, gguf_kernels
from services.engine.gguf_kernels import FORMATS, ISAS, GGUFWeight
from services.engine.loader import load_weights
from services.engine.quant import (PREFILL_MIN_ROWS, DenseLinear, GGUFLinear, decode_in_bfloat16,
                                     decode_in_int16, native_bfloat16, prefill_in_bfloat16, prefill_in_int16,
                                     prefill_in_int8)
from services.engine.runner import ModelRunner
from tests.integration.engine_model import oracle
from tests.unit.engine import tiny_models as tm


@pytest.fixture(scope="module", params=list(ISAS))
def glib(request):
    """Each ISA build of the kernel; skipped where this CPU lacks the ISA (not a missing part:
    the other build covers the machine)."""
    if request.param not in gguf_kernels.runnable_isas():
        pytest.skip(f"this CPU lacks {request.param}")
    lib = gguf_kernels.load(request.param)
    assert lib is not None, f"the {request.param} build failed on a CPU that has it"
    assert lib.gguf_isa().decode() == request.param
    return lib


def blocks(kind: str, n: int, k: int, seed: int = 0) -> GGUFWeight:
    g = torch.Generator().manual_seed(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_K", "Q6_K"):  # gguf-py cannot quantize K-quants: random blocks, sane f16 scales
        size, at, count = {"Q4_K": (144, 0, 2), "Q6_K": (210, 208, 1)}[kind]
        raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=g)
        scale = (torch.rand(n, k // 256, count, generator=g) * 0.01).half()
        raw[:, :, at:at + 2 * count] = scale.view(torch.uint8).reshape(n, k // 256, 2 * count)
        return GGUFWeight(kind, raw.reshape(n, -1).contiguous(), (n, k))
    a = (torch.randn(n, k, generator=g) * 0.1).numpy()
    return GGUFWeight(kind, torch.from_numpy(gguf.quants.quantize(a, qtype)), (n, k))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_dequantizes_exactly_as_the_reference(glib, kind):
    w = blocks(kind, 37, 256)
    assert torch.equal(gguf_kernels.dequantize(glib, w), w.dequantize())


@pytest.mark.parametrize("kind", list(FORMATS))
def test_linear_matches_float32_over_the_dequantized_weights(glib, kind):
    # rows 1-8 take the direct tiles (4 at a time), 9+ the dequantized panels (tiles of 3 or 6
    # input rows, and what is left); N = 37 leaves remainders
    w = blocks(kind, 37, 512, seed=1)
    ref_w = w.dequantize().double()
    x = torch.randn(14, 512)
    for m in (0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 14):
        y = gguf_kernels.linear(glib, x[:m], w)
        assert y.shape == (m, 37)
        ref = (x[:m].double() @ ref_w.T).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref_w.abs().max().item() * 8)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_a_rows_result_does_not_depend_on_the_batch(glib, kind):
    w = blocks(kind, 50, 256, seed=2)
    x = torch.randn(14, 256)
    full = gguf_kernels.linear(glib, x, w)  # a panel, its input rows in tiles and remainders
    for i in range(14):
        assert torch.equal(gguf_kernels.linear(glib, x[i:i + 1], w)[0], full[i])
    assert torch.equal(gguf_kernels.linear(glib, x[2:5], w), full[2:5])
    assert torch.equal(gguf_kernels.linear(glib, x[1:9], w), full[1:9])  # direct, two passes
    for rows in (slice(0, 9), slice(1, 12), slice(3, 13)):  # panels of 9, 11 and 10 rows
        assert torch.equal(gguf_kernels.linear(glib, x[rows], w), full[rows])
    # a prompt's rows go in blocks of 128 (here 128 + 128 + 5, the last on the direct tiles)
    x = torch.randn(261, 256)
    full = gguf_kernels.linear(glib, x, w)
    for i in (0, 127, 128, 255, 256, 260):
        assert torch.equal(gguf_kernels.linear(glib, x[i:i + 1], w)[0], full[i])
    assert torch.equal(gguf_kernels.linear(glib, x[100:160], w), full[100:160])


@pytest.mark.parametrize("kind", list(FORMATS))
def test_the_weights_multiplied_are_exactly_the_reference_dequantization(glib, kind):
    """A one-hot input row picks one column of weights out of every product unchanged: what
    each tile multiplies is the reference's float32 weight, bit for bit (one row, direct tiles
    of up to 4, panels from 9)."""
    w = blocks(kind, 37, 256, seed=3)
    ref = w.dequantize()
    for cols in ([5], [0, 31, 32, 255], list(range(100, 112))):
        assert torch.equal(gguf_kernels.linear(glib, torch.eye(256)[cols], w), ref[:, cols].T)


@pytest.fixture(scope="module")
def bf16lib():
    """The build with the bfloat16-arithmetic kernel; skipped where this CPU lacks AVX512-BF16."""
    if "avx512bf16" not in gguf_kernels.runnable_isas():
        pytest.skip("this CPU lacks avx512_bf16")
    lib = gguf_kernels.load("avx512bf16")
    assert gguf_kernels.has_bfloat16(lib), "the avx512bf16 build failed on a CPU that has it"
    return lib


@pytest.mark.parametrize("kind", list(FORMATS))
def test_bfloat16_weights_are_the_files_numbers_rounded_to_nearest(bf16lib, kind):
    w = blocks(kind, 37, 256)
    assert torch.equal(gguf_kernels.dequantize_bf16(bf16lib, w), w.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_bfloat16_linear_sums_the_rounded_products_in_float32(bf16lib, kind):
    w = blocks(kind, 37, 512, seed=1)
    ref_w = w.dequantize().to(torch.bfloat16).double()
    x = torch.randn(13, 512)
    for m in (0, 1, 2, 3, 4, 5, 7, 8, 9, 13):
        y = gguf_kernels.linear(bf16lib, x[:m], w, bf16=True)
        ref = (x[:m].to(torch.bfloat16).double() @ ref_w.T).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref_w.abs().max().item() * 8)
        if m:  # and not the float32 arithmetic
            assert not torch.equal(y, gguf_kernels.linear(bf16lib, x[:m], w))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_a_rows_bfloat16_result_does_not_depend_on_the_batch(bf16lib, kind):
    w = blocks(kind, 50, 256, seed=2)
    x = torch.randn(17, 256)
    full = gguf_kernels.linear(bf16lib, x, w, bf16=True)  # panel tiles
    for i in range(17):
        assert torch.equal(gguf_kernels.linear(bf16lib, x[i:i + 1], w, bf16=True)[0], full[i])
    for rows in (slice(2, 5), slice(3, 8), slice(0, 6), slice(1, 9)):  # 4-row, 5-row tiles, panels
        assert torch.equal(gguf_kernels.linear(bf16lib, x[rows], w, bf16=True), full[rows])


@pytest.fixture(scope="module")
def illib():
    """kernels/gguf_interleaved.c; skipped where this CPU lacks AVX512-BF16."""
    if "avx512bf16" not in gguf_kernels.runnable_isas():
        pytest.skip("this CPU lacks avx512_bf16")
    lib = gguf_kernels.load_interleaved()
    assert lib is not None, "the interleaved kernel failed to build on a CPU with AVX512-BF16"
    return lib


@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVED_FORMATS)
def test_interleaved_linear_uses_the_exact_weights_and_bfloat16_inputs(illib, kind):
    w = blocks(kind, 48, 512, seed=3)
    packed = gguf_kernels.pack_interleaved(illib, w)
    assert packed.shape == w.blocks.shape
    exact = w.dequantize().double()
    x = torch.randn(19, 512)
    for m in (0, 1, 2, 5, 8, 9, 19):  # tiles of up to 8 input rows
        y = gguf_kernels.linear_interleaved(illib, x[:m], packed, w)
        ref = (x[:m].to(torch.bfloat16).double() @ exact.T).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * exact.abs().max().item() * 8)
    full = gguf_kernels.linear_interleaved(illib, x, packed, w)
    for i in range(19):  # a row's result whatever else is in the batch
        assert torch.equal(gguf_kernels.linear_interleaved(illib, x[i:i + 1], packed, w)[0], full[i])
    assert torch.equal(gguf_kernels.linear_interleaved(illib, x[3:12], packed, w), full[3:12])


def test_interleaving_needs_rows_in_sixteens_and_its_formats(illib):
    assert gguf_kernels.pack_interleaved(illib, blocks("Q4_1", 40, 64)) is None
    assert gguf_kernels.pack_interleaved(illib, blocks("Q4_K", 32, 256)) is None


def test_decode_rows_of_a_q4_1_file_take_the_interleaved_kernel(illib):
    """The default's decode rows: the file's exact weights (closer to float32 than the same
    rows with each weight rounded to bfloat16), on AMX tiles where the CPU has them; rows in
    no group of 16 keep the blocks."""
    lib = gguf_kernels.load()
    w = blocks("Q4_1", 64, 256, seed=4)
    fast = GGUFLinear(w, torch.float32, lib, decode_bf16=True)
    x = torch.randn(5, 256)
    exact = (x.double() @ w.dequantize().double().T).float()
    rounded = gguf_kernels.linear(lib, x, w, bf16=True)
    packed = gguf_kernels.pack_interleaved(illib, w)
    assert torch.equal(fast(x), gguf_kernels.linear_interleaved(illib, x, packed, w, gguf_kernels.interleaved_amx(illib)))
    assert (fast(x) - exact).abs().mean() < (rounded - exact).abs().mean()
    odd = GGUFLinear(blocks("Q4_1", 40, 256), torch.float32, lib, decode_bf16=True)
    assert torch.equal(odd(x), gguf_kernels.linear(lib, x, odd.weight, bf16=True))


@pytest.fixture(scope="module")
def amxlib(illib):
    """The interleaved kernel's AMX build; skipped where this CPU (under the ISA cap) lacks AMX-BF16."""
    if not gguf_kernels.AMX_CPU_FLAGS <= cpu_kernels.cpu_flags():
        pytest.skip("this CPU lacks amx_bf16")
    assert gguf_kernels.interleaved_amx(illib), "the AMX kernel failed to build or enable on an AMX CPU"
    return illib


@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVED_FORMATS)
@pytest.mark.parametrize("k", [32, 64, 96, 512])  # 1, 2, 3 and 16 blocks a row (the ring of four)
def test_amx_tiles_use_the_exact_weights_and_bfloat16_inputs(amxlib, kind, k):
    """The AMX kernel computes what gguf_linear_il16 computes, in another order of each
    block's 32 exact products."""
    w = blocks(kind, 64, k, seed=5)
    packed = gguf_kernels.pack_interleaved(amxlib, w)
    exact = w.dequantize().double()
    x = torch.randn(40, k)
    for m in (0, 1, 2, 15, 16, 17, 31, 32, 33, 40):  # partial, one, two and several input tiles
        y = gguf_kernels.linear_interleaved(amxlib, x[:m], packed, w, amx=True)
        ref = (x[:m].to(torch.bfloat16).double() @ exact.T).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * exact.abs().max().item() * 8)
        torch.testing.assert_close(y, gguf_kernels.linear_interleaved(amxlib, x[:m], packed, w),
                                   rtol=1e-5, atol=1e-5 * exact.abs().max().item() * 8)


@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVED_FORMATS)
def test_an_amx_rows_result_does_not_depend_on_the_batch(amxlib, kind):
    w = blocks(kind, 48, 256, seed=6)
    packed = gguf_kernels.pack_interleaved(amxlib, w)
    x = torch.randn(37, 256)
    full = gguf_kernels.linear_interleaved(amxlib, x, packed, w, amx=True)
    for i in range(37):
        assert torch.equal(gguf_kernels.linear_interleaved(amxlib, x[i:i + 1], packed, w, amx=True)[0], full[i])
    for rows in (slice(3, 19), slice(0, 32), slice(5, 37), slice(30, 33)):
        assert torch.equal(gguf_kernels.linear_interleaved(amxlib, x[rows], packed, w, amx=True), full[rows])


@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVED_FORMATS)
def test_amx_decode_swiglu_gives_silu_mul_of_the_gate_up_rows_bit_for_bit(amxlib, kind):
    """A [gate; up] matrix's decode rows in one pass give what its multiply then silu_mul give,
    bit for bit, for one, a partial, one whole and several tiles of input rows."""
    fused = cpu_kernels.load()
    w = blocks(kind, 96, 128, seed=8)  # gate: rows 0..47, up: 48..95
    packed = gguf_kernels.pack_interleaved(amxlib, w)
    x = torch.randn(64, 128) * 2
    for m in (1, 5, 16, 17, 40, 64):
        want = cpu_kernels.silu_mul(fused, gguf_kernels.linear_interleaved(amxlib, x[:m], packed, w, amx=True))
        got = gguf_kernels.linear_interleaved_swiglu(amxlib, x[:m], packed, w)
        assert got.shape == (m, 48) and torch.equal(got, want), m
    with pytest.raises(ValueError, match="rejected"):  # gate and up must be whole groups of 16
        odd = blocks(kind, 48, 128, seed=9)
        gguf_kernels.linear_interleaved_swiglu(amxlib, x[:2], gguf_kernels.pack_interleaved(amxlib, odd), odd)


@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVED_FORMATS)
def test_amx_argmax_gives_argmax_rows_of_the_product_without_it(amxlib, kind):
    """Each row's argmax without the [M, N] product (gguf_argmax_il16_amx): the index
    argmax_rows gives over the multiply's output, for one, a partial, one whole and several
    tiles of rows. Every weight row is one of 37 (so each row's largest value stands at many
    columns, across groups and threads): the first of them wins; a row of NaN gives 0."""
    fused = cpu_kernels.load()
    base = blocks(kind, 48, 64, seed=10)
    w = GGUFWeight(kind, base.blocks[torch.arange(480) % 37].contiguous(), (480, 64))
    packed = gguf_kernels.pack_interleaved(amxlib, w)
    x = torch.randn(64, 64) * 2
    x[9] = float("nan")
    for m in (1, 5, 16, 17, 40, 64):
        y = gguf_kernels.linear_interleaved(amxlib, x[:m], packed, w, amx=True)
        want = cpu_kernels.argmax_rows(fused, y)
        got = gguf_kernels.argmax_interleaved(amxlib, x[:m], packed, w)
        assert got.dtype == torch.int64 and torch.equal(got, want), m
        assert torch.equal(got, torch.argmax(y, dim=1)), m  # torch's rules too
        assert bool((got < 37).all()), m  # the first copy of the largest row
    assert gguf_kernels.argmax_interleaved(amxlib, x[9:10], packed, w).tolist() == [0]
    with pytest.raises(ValueError, match="rejected"):  # rows in whole groups of 16
        odd = blocks(kind, 40, 64, seed=11)
        gguf_kernels.argmax_interleaved(amxlib, x[:2], packed[:0], odd)


@pytest.mark.parametrize("n, k", [(16, 32), (48, 64), (64, 576), (96, 1536)])
def test_amx_bfloat16_gemm_sums_bfloat16_products_in_float32_whatever_the_batch(amxlib, n, k):
    """Prompt rows' multiply on AMX tiles (bf16_gemm_amx): x and w as bfloat16, exact products,
    float32 sums; any number of rows (partial tiles, one, several blocks of rows), an odd
    number of 16-column tiles; bfloat16 out is float32 out rounded; each row's result the same
    bits alone or in any batch."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(1100, k, generator=g).to(torch.bfloat16)
    packed = gguf_kernels.pack_bf16_tiles(amxlib, w)
    full = gguf_kernels.gemm_bf16_amx(amxlib, x, packed, n)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(full.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(gguf_kernels.gemm_bf16_amx(amxlib, x, packed, n, torch.bfloat16), full.to(torch.bfloat16))
    for rows in (slice(0, 1), slice(7, 8), slice(0, 15), slice(3, 20), slice(0, 32), slice(5, 38),
                 slice(100, 1100), slice(1099, 1100)):
        assert torch.equal(gguf_kernels.gemm_bf16_amx(amxlib, x[rows], packed, n), full[rows]), rows
    assert gguf_kernels.pack_bf16_tiles(amxlib, w[:, :16]) is None  # K not a multiple of 32
    assert gguf_kernels.gemm_bf16_amx(amxlib, x[:0], packed, n).shape == (0, n)


@pytest.mark.parametrize("n, k", [(32, 32), (96, 64), (3072, 576)])
def test_amx_swiglu_gives_silu_mul_of_the_bfloat16_gate_up_output_bit_for_bit(amxlib, n, k):
    """The gate/up multiply with SwiGLU fused (bf16_gemm_amx_swiglu): the same bits as the
    bfloat16 gate/up output followed by silu_mul, for any number of rows; a row's result the
    same alone or in a batch; [gate; up] must split into whole tiles (n % 32)."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    x = (torch.randn(300, k, generator=g) * 3).to(torch.bfloat16)  # gate sums well past silu's knee
    packed = gguf_kernels.pack_bf16_tiles(amxlib, w)
    fl = cpu_kernels.load()
    full = gguf_kernels.gemm_bf16_amx_swiglu(amxlib, x, packed, n)
    assert full.shape == (300, n // 2) and full.dtype == torch.bfloat16
    assert torch.equal(full, cpu_kernels.silu_mul(fl, gguf_kernels.gemm_bf16_amx(amxlib, x, packed, n, torch.bfloat16)))
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    torch.testing.assert_close(full.double(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(0, 33), slice(250, 300)):
        assert torch.equal(gguf_kernels.gemm_bf16_amx_swiglu(amxlib, x[rows], packed, n), full[rows]), rows
    assert gguf_kernels.gemm_bf16_amx_swiglu(amxlib, x[:0], packed, n).shape == (0, n // 2)
    odd = gguf_kernels.pack_bf16_tiles(amxlib, w[:48])
    with pytest.raises(ValueError, match="swiglu rejected a 48x"):
        gguf_kernels.gemm_bf16_amx_swiglu(amxlib, x, odd, 48)


@pytest.mark.parametrize("kind", gguf_kernels.I16_FORMATS)
def test_the_16_bit_input_keeps_15_bits_of_each_blocks_largest(glib, kind):
    bits = 12 if kind == "Q8_0" else 15  # Q8_0: its block sums stay exact in float32 too
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([1e-3, 1.0, 300.0, 2.0 ** -100]).repeat_interleave(32)  # per block of 32
    x = torch.randn(3, 128, generator=g) * scale
    x[1, 64:96] = 0.0  # an all-zero block
    x[2, 32:64] = torch.arange(32.0) - 16  # small integers: on the grid already
    r = gguf_kernels.input_i16(glib, x, kind)
    for blk in range(4):
        a, b = x[:, 32 * blk:32 * (blk + 1)], r[:, 32 * blk:32 * (blk + 1)]
        top = a.abs().amax(dim=1, keepdim=True)
        # s = 2^(e - bits) where top < 2^e: the smallest power of two that keeps |X| < 2^bits
        s = torch.where(top > 0, torch.exp2(torch.floor(torch.log2(top)) + 1 - bits), torch.ones_like(top))
        assert torch.equal(b / s, torch.round(b / s)), blk  # X * s, X integer
        assert ((b / s).abs() <= 2 ** bits).all()
        assert ((a - b).abs() <= s / 2).all(), blk  # to nearest
    assert torch.equal(r[1, 64:96], x[1, 64:96]) and torch.equal(r[2, 32:64], x[2, 32:64])
    with pytest.raises(ValueError, match="input_i16 rejected"):
        gguf_kernels.input_i16(glib, torch.randn(2, 48), kind)


@pytest.fixture
def float_rows(glib):
    """Sets the row count from which glib's gguf_linear_i16 takes its float32 tiles (0: never),
    put back after the test."""
    before = glib.gguf_i16_float_rows(-1)
    yield glib.gguf_i16_float_rows
    glib.gguf_i16_float_rows(before)


@pytest.mark.parametrize("kind", gguf_kernels.I16_FORMATS)
@pytest.mark.parametrize("k", [256, 1088])
def test_i16_kernel_is_the_files_weights_times_the_rounded_input(glib, float_rows, kind, k):
    # N = 40: five groups of 8 rows (two pairs and one alone). By rows: integer tiles of up to 4
    # input rows on the packed blocks, then (from 8 rows, from 4 in the AVX-512 builds) on a
    # 16-bit panel of a pair of groups (in chunks of blocks where K > 1024; the AVX-512 builds'
    # tiles 64 bytes wide), in runs of 256 rows; or, where a CPU's integer multiplies are slow,
    # float32 tiles from 12 rows. Every path, the same bits.
    w = blocks(kind, 40, k, seed=3)
    packed = gguf_kernels.pack_i16(glib, w)
    assert packed.shape == w.blocks.shape and packed.dtype == torch.uint8
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(4)) * 3
    float_rows(0)
    full = gguf_kernels.linear_i16(glib, x, packed, w)
    ref = gguf_kernels.input_i16(glib, x, kind).double() @ w.dequantize().double().T
    # only float32 rounding of each block's two scalings and the row's sum: the weights are
    # the file's, the block sums exact
    torch.testing.assert_close(full.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    exact = x.double() @ w.dequantize().double().T  # and the input's rounding stays small
    tol = 2e-3 if kind == "Q8_0" else 2e-4
    torch.testing.assert_close(full.double(), exact, rtol=0, atol=tol * exact.abs().max().item())
    for rows in (0, 12):
        float_rows(rows)
        assert torch.equal(gguf_kernels.linear_i16(glib, x, packed, w), full), rows
        for m in (*range(1, 21), 40, 257):  # a row's result: the same bits whatever shares its call
            for at in (0, 300 - m):
                part = gguf_kernels.linear_i16(glib, x[at:at + m], packed, w)
                assert torch.equal(part, full[at:at + m]), (rows, m, at)
    assert gguf_kernels.linear_i16(glib, x[:0], packed, w).shape == (0, 40)
    assert float_rows(-1) == 12  # -1 reads the setting


@pytest.mark.parametrize("kernel, kind", [*(("i16", kind) for kind in gguf_kernels.I16_FORMATS),
                                          *(("i8", kind) for kind in gguf_kernels.I8_FORMATS)])
def test_integer_kernels_give_the_same_bits_in_every_build(kernel, kind):
    # 16-bit input: the AVX2 build's VPMADDWD + VPADDD, AVX-VNNI's and AVX512-VNNI's VPDPWSSD;
    # 8-bit input: VPMADDUBSW with 16-bit sums, or VPDPBUSD; the AVX-512 builds' 64-byte tiles:
    # the same integers and the same float32 operations per row, so a fleet of mixed CPUs
    # decodes the same tokens (the builds this CPU runs; two at least on any CPU with AVX-512)
    isas = gguf_kernels.runnable_isas()
    if len(isas) < 2:
        pytest.skip("this CPU runs one build of the kernel")
    linear = gguf_kernels.linear_i16 if kernel == "i16" else gguf_kernels.linear_i8
    libs = {name: gguf_kernels.load(name) for name in isas}
    for k in (256, 1088, 2080):
        w = blocks(kind, 48, k, seed=k)
        x = torch.randn(257, k, generator=torch.Generator().manual_seed(5)) * 3
        want = {}
        for name, lib in libs.items():
            packed = gguf_kernels.pack_i16(lib, w)
            for m in (*range(1, 21), 40, 257):
                got = linear(lib, x[:m], packed, w)
                assert torch.equal(got, want.setdefault(m, got)), (name, k, m)


def test_the_8_bit_input_rounds_each_block_to_127_steps_of_its_largest(glib):
    g = torch.Generator().manual_seed(8)
    scale = torch.tensor([1e-3, 1.0, 300.0, 2.0 ** -110]).repeat_interleave(32)  # per block of 32
    x = torch.randn(3, 128, generator=g) * scale
    x[1, 64:96] = 0.0  # an all-zero block
    x[2, 0:32] = torch.arange(32.0) - 16  # its largest, -16, is 127 steps: -16 / 127 each
    r = gguf_kernels.input_i8(glib, x)
    for blk in range(3):
        a, b = x[:, 32 * blk:32 * (blk + 1)], r[:, 32 * blk:32 * (blk + 1)]
        s = a.abs().amax(dim=1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        steps = b.double() / s.double()
        assert (steps - steps.round()).abs().max() < 1e-4, blk  # X * s, X an integer ...
        assert (steps.abs() <= 127 + 1e-4).all()  # ... within +-127, the largest at 127
        assert ((a - b).abs() <= s / 2 * (1 + 1e-5)).all(), blk  # to nearest
    assert torch.equal(r[:, 96:], torch.zeros(3, 32))  # blocks below 2^-100 round to zero
    assert torch.equal(r[1, 64:96], x[1, 64:96])
    assert r[2, 0].item() == -16.0 and r[2, 31].item() == pytest.approx(15.0, abs=16 / 254)
    with pytest.raises(ValueError, match="input_i8 rejected"):
        gguf_kernels.input_i8(glib, torch.randn(2, 48))


@pytest.mark.parametrize("kind", gguf_kernels.I8_FORMATS)
@pytest.mark.parametrize("k", [256, 2080])
def test_i8_kernel_is_the_files_weights_times_the_rounded_input(glib, kind, k):
    # N = 40: two pairs of groups of 8 rows and one alone; K = 2080: 65 blocks, two chunks of
    # the pair's 8-bit panel; tiles of up to 3 input rows (8 in the AVX-512 builds), in runs of
    # 256 rows. Every path, the same bits.
    w = blocks(kind, 40, k, seed=5)
    packed = gguf_kernels.pack_i16(glib, w)  # the 16-bit kernel's layout: no copy of its own
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(6)) * 3
    full = gguf_kernels.linear_i8(glib, x, packed, w)
    ref = gguf_kernels.input_i8(glib, x).double() @ w.dequantize().double().T
    # only float32 rounding of each block's two scalings and the row's sum: the weights are the
    # file's, the block sums exact
    torch.testing.assert_close(full.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    exact = x.double() @ w.dequantize().double().T  # llama.cpp's rounding: ~100x the 16-bit's
    err = (full.double() - exact).abs().max().item() / exact.abs().max().item()
    assert 1e-4 < err < 2e-2
    for m in (*range(1, 21), 40, 257):  # a row's result: the same bits whatever shares its call
        for at in (0, 300 - m):
            assert torch.equal(gguf_kernels.linear_i8(glib, x[at:at + m], packed, w), full[at:at + m]), (m, at)
    assert gguf_kernels.linear_i8(glib, x[:0], packed, w).shape == (0, 40)


def test_i8_kernel_takes_only_the_4_bit_formats(glib):
    q8 = blocks("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="gguf_linear_i8 rejected a Q8_0 16x64"):
        gguf_kernels.linear_i8(glib, torch.randn(2, 64), gguf_kernels.pack_i16(glib, q8), q8)
    w = blocks("Q4_0", 16, 64)
    packed = gguf_kernels.pack_i16(glib, w)
    x, y = torch.randn(1, 64), torch.empty(1, 16)
    call = lambda fmt, n, k: glib.gguf_linear_i8(fmt, x.data_ptr(), packed.data_ptr(), y.data_ptr(), 1, n, k)
    assert call(2, 16, 64) == 0 and torch.equal(y, gguf_kernels.linear_i8(glib, x, packed, w))
    assert call(2, 12, 64) == -1 and call(2, 16, 48) == -1 and call(8, 16, 64) == -1  # N, K, Q8_0


def test_i16_kernel_takes_only_its_formats_in_rows_of_eight(glib):
    assert gguf_kernels.pack_i16(glib, blocks("Q4_K", 16, 256)) is None
    assert gguf_kernels.pack_i16(glib, blocks("Q4_1", 12, 64)) is None  # 12 rows: not in eights
    w = blocks("Q4_1", 16, 64)
    packed = gguf_kernels.pack_i16(glib, w)
    x, y = torch.randn(1, 64), torch.empty(1, 16)
    call = lambda fmt, n, k: glib.gguf_linear_i16(fmt, x.data_ptr(), packed.data_ptr(), y.data_ptr(), 1, n, k)
    assert call(3, 16, 64) == 0 and torch.equal(y, gguf_kernels.linear_i16(glib, x, packed, w))
    assert call(3, 12, 64) == -1 and call(3, 16, 48) == -1 and call(12, 16, 64) == -1  # N, K, Q4_K


def test_int16_decode_rows_and_float32_prompt_rows():
    lib = gguf_kernels.load()
    if lib is None:
        pytest.skip("no block kernel on this CPU")
    w = blocks("Q4_1", 64, 96)
    fast, plain = GGUFLinear(w, torch.float32, lib, decode_i16=True), GGUFLinear(w, torch.float32, lib)
    packed = gguf_kernels.pack_i16(lib, w)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(fast(x), gguf_kernels.linear_i16(lib, x, packed, w))  # all decode rows
    assert not torch.equal(fast(x), plain(x))  # the 16-bit input really used
    y = fast(x, 3)
    assert torch.equal(y[:3], plain(x[:3])) and torch.equal(y[3:], fast(x[3:]))  # prompt rows float32
    assert torch.equal(fast(x, 7), plain(x))
    fn, code, ptr, n, k = fast.decode_kernel()  # what the C decode step calls
    assert (fn, n, k) == (ctypes.cast(lib.gguf_linear_i16, ctypes.c_void_p).value, 64, 96)
    assert torch.equal(gguf_kernels.linear_i16(lib, x, fast._i16, w), fast(x))  # its layout
    # prompt rows on the 16-bit input too: one call for the whole step
    both = GGUFLinear(w, torch.float32, lib, decode_i16=True, prefill_i16=True)
    for prompt_rows in (0, 3, 7):
        assert torch.equal(both(x, prompt_rows), fast(x))
    # 16-bit prompt rows beside float32 decode rows
    prompt_only = GGUFLinear(w, torch.float32, lib, prefill_i16=True)
    y = prompt_only(x, 3)
    assert torch.equal(y[:3], fast(x[:3])) and torch.equal(y[3:], plain(x[3:]))
    assert torch.equal(prompt_only(x), plain(x)) and prompt_only.decode_kernel()[0] == plain.decode_kernel()[0]
    # 8-bit prompt rows beside 16-bit decode rows: two calls; none for Q8_0
    i8 = GGUFLinear(w, torch.float32, lib, decode_i16=True, prefill_i16=True, prefill_i8=True)
    y = i8(x, 3)
    assert torch.equal(y[:3], gguf_kernels.linear_i8(lib, x[:3], packed, w)) and torch.equal(y[3:], fast(x[3:]))
    assert not torch.equal(y[:3], fast(x[:3]))
    assert torch.equal(i8(x), fast(x)) and i8.decode_kernel()[0] == fast.decode_kernel()[0]
    q8 = GGUFLinear(blocks("Q8_0", 64, 96), torch.float32, lib, decode_i16=True, prefill_i16=True, prefill_i8=True)
    assert q8._prefill_i16 and not q8._prefill_i8
    q4k = GGUFLinear(blocks("Q4_K", 16, 256), torch.float32, lib, decode_i16=True)
    xk = torch.randn(2, 256)  # no 16-bit kernel for Q4_K: float32 at every M
    assert torch.equal(q4k(xk), GGUFLinear(q4k.weight, torch.float32, lib)(xk))


def test_decode_dtype_follows_the_cpu_unless_chosen():
    here = gguf_kernels.has_bfloat16(gguf_kernels.load())
    assert decode_in_bfloat16("auto", "cpu") == here
    assert not decode_in_bfloat16("float32", "cpu") and not decode_in_bfloat16("auto", "cuda")
    if here:
        assert decode_in_bfloat16("bfloat16", "cpu")
    else:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            decode_in_bfloat16("bfloat16", "cpu")
    with pytest.raises(ValueError, match="decode_dtype"):
        decode_in_bfloat16("float16", "cpu")
    have = gguf_kernels.load() is not None
    assert decode_in_int16("auto", "cpu") == (have and not here)  # where bfloat16 is not native
    assert decode_in_int16("int16", "cpu") == have and not decode_in_bfloat16("int16", "cpu")
    assert not decode_in_int16("float32", "cpu") and not decode_in_int16("bfloat16", "cpu")
    assert not decode_in_int16("auto", "cuda")
    # prompt rows: int16 by default where bfloat16 is not native and integer multiplies are the faster
    fast16 = have and not native_bfloat16() and gguf_kernels.int16_multiplies_fast()
    assert prefill_in_int16("auto", "cpu") == fast16
    assert not prefill_in_int16("auto", "cpu", decode_int16=False)  # auto: as the decode rows
    assert prefill_in_int16("int16", "cpu") == have and not prefill_in_bfloat16("int16", "cpu")
    assert not prefill_in_int16("float32", "cpu") and not prefill_in_int16("bfloat16", "cpu")
    assert not prefill_in_int16("auto", "cuda")
    with pytest.raises(ValueError, match="prefill_dtype"):
        prefill_in_int16("float16", "cpu")


def test_weight_checks_its_blocks():
    w = blocks("Q4_1", 8, 64)  # one row: two blocks of 32
    with pytest.raises(ValueError, match="do not hold"):
        GGUFWeight("Q4_1", w.blocks[:, :-1], (8, 64))
    with pytest.raises(ValueError, match="no kernel"):
        GGUFWeight("Q5_K", w.blocks, (8, 64))
    assert GGUFWeight.cat([w, blocks("Q8_0", 8, 64)]) is None  # mixed formats stay apart
    both = GGUFWeight.cat([w, w])
    assert both.shape == (16, 64) and torch.equal(both.dequantize()[8:], w.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
def test_loader_keeps_blocks_in_the_float_paths_row_order(tmp_path, qtype):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), qtype)
    plain = load_weights(path)
    kept = load_weights(path, keep_blocks=True)
    assert set(kept.quantized) >= {"layers.0.wq", "layers.1.w_down", "embed"}
    for name, w in kept.quantized.items():
        assert name not in kept.tensors or name == "embed"  # only the embedding kept both ways
        assert torch.equal(w.dequantize(), plain.tensors[name]), name


def test_default_mode_serves_the_files_blocks(tmp_path):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    # float32 arithmetic on the blocks: the float32-dequantized model's numbers, summed in
    # another order (the default's bfloat16 arithmetic: the test below)
    fast = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", decode_dtype="float32")
    exact = ModelRunner(path, num_blocks=32, num_threads=1)
    eager = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", kernels=False)
    layer = fast.model.layers[0]
    if gguf_kernels.load() is not None:
        assert isinstance(layer.qkv, GGUFLinear) and layer.qkv.weight.kind == "Q4_1"
    assert isinstance(eager.model.layers[0].qkv, DenseLinear)  # torch: dequantized once
    assert fast.kv_cache_dtype == "float16" and exact.kv_cache_dtype == "float32"
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    a = oracle.runner_last_logits(exact, prompt)
    for r in (fast, eager):
        torch.testing.assert_close(oracle.runner_last_logits(r, prompt), a, rtol=1e-3, atol=1e-3)
    assert oracle.runner_greedy(fast, prompt, 12) == oracle.runner_greedy(exact, prompt, 12)


def test_default_mode_multiplies_in_bfloat16_where_the_cpu_does(tmp_path, bf16lib):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    default = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto")
    f32 = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", decode_dtype="float32")
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    a, b = oracle.runner_last_logits(default, prompt), oracle.runner_last_logits(f32, prompt)
    assert not torch.equal(a, b)  # bfloat16 arithmetic really used
    torch.testing.assert_close(a, b, rtol=0, atol=0.1)  # within its rounding


def test_default_mode_takes_16_bit_decode_inputs_where_bfloat16_is_not_native(tmp_path):
    if not decode_in_int16("auto", "cpu"):
        pytest.skip("this CPU's default decode is bfloat16 (the test above) or has no block kernel")
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    default = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto")
    f32 = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", decode_dtype="float32")
    exact = ModelRunner(path, num_blocks=32, num_threads=1)
    assert default.model.layers[0].qkv._i16 is not None and f32.model.layers[0].qkv._i16 is None
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    # the prompt's rows in float32 or (prefill_in_int16) int16, the logits' rows (what the head
    # is given) as decode rows
    a, b = oracle.runner_last_logits(default, prompt), oracle.runner_last_logits(f32, prompt)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
    assert oracle.runner_greedy(default, prompt, 16) == oracle.runner_greedy(exact, prompt, 16)


def test_16_bit_prompt_rows_stay_within_the_inputs_rounding(tmp_path):
    if not gguf_kernels.runnable_isas():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    assert gguf_kernels.load() is not None, "the block kernel failed to build on a CPU that runs it"
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    both = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", prefill_dtype="int16",
                       decode_dtype="int16")
    decode_only = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", prefill_dtype="float32",
                              decode_dtype="int16")
    exact = ModelRunner(path, num_blocks=32, num_threads=1)
    qkv = both.model.layers[0].qkv
    assert qkv._prefill_i16 and qkv._decode_i16 and not decode_only.model.layers[0].qkv._prefill_i16
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    a, b = oracle.runner_last_logits(both, prompt), oracle.runner_last_logits(decode_only, prompt)
    assert not torch.equal(a, b)  # the prompt's rows really took the 16-bit input
    torch.testing.assert_close(a, oracle.runner_last_logits(exact, prompt), rtol=0, atol=1e-3)
    assert oracle.runner_greedy(both, prompt, 16) == oracle.runner_greedy(exact, prompt, 16)


def test_8_bit_prompt_rows_are_chosen_and_keep_q_k_v_at_16_bits(tmp_path):
    if not gguf_kernels.runnable_isas():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    assert gguf_kernels.load() is not None, "the block kernel failed to build on a CPU that runs it"
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    i8 = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", prefill_dtype="int8",
                     decode_dtype="int16", kv_cache_dtype="float32")
    i16 = ModelRunner(path, num_blocks=32, num_threads=1, quantization="auto", prefill_dtype="int16",
                      decode_dtype="int16", kv_cache_dtype="float32")
    exact = ModelRunner(path, num_blocks=32, num_threads=1)
    assert i8.block_arithmetic == {"prefill": "int8", "decode": "int16"}
    assert i16.block_arithmetic["prefill"] == "int16"
    layer = i8.model.layers[0]
    assert not layer.qkv._prefill_i8 and layer.qkv._prefill_i16  # q, k, v: 16-bit
    assert layer.o._prefill_i8 and layer.gate_up._prefill_i8 and layer.down._prefill_i8
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    a, b = oracle.runner_last_logits(i8, prompt), oracle.runner_last_logits(i16, prompt)
    ref = oracle.runner_last_logits(exact, prompt)
    assert not torch.equal(a, b)  # the prompt's rows really took the 8-bit input
    err8, err16 = (a - ref).abs().max().item(), (b - ref).abs().max().item()
    assert err16 < err8 < 0.05 * ref.abs().max().item()  # coarser than 16 bits, still close


def test_default_decode_tokens_do_not_depend_on_how_many_decode_together(tmp_path):
    # 14 sequences decoding in one batch (the 16-bit kernel's float32 tiles from 12 rows on)
    # against each alone (its integer tiles): the same greedy tokens
    from services.engine.interface import Batch, SamplingParams, SeqChunk
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "Q4_1", tokenizer=True)
    r = ModelRunner(path, num_blocks=256, num_threads=2, quantization="auto")
    prompts = [[5 + i, 17, 33 + 2 * i, 42, 61 - i, 7] for i in range(14)]
    alone = [oracle.runner_greedy(r, p, 10, seq_id=100 + i) for i, p in enumerate(prompts)]
    g = SamplingParams()
    tables = {i: list(range(16 * i, 16 * i + 2)) for i in range(14)}
    out = r.execute(Batch([SeqChunk(i, p, 0, tables[i], True, g, p) for i, p in enumerate(prompts)]))
    toks = {i: [out.sampled[i].token_id] for i in range(14)}
    for step in range(9):
        chunks = [SeqChunk(i, [toks[i][-1]], len(p) + step, tables[i], True, g, p, toks[i])
                  for i, p in enumerate(prompts)]
        out = r.execute(Batch(chunks))
        for i in range(14):
            toks[i].append(out.sampled[i].token_id)
    r.execute(Batch([], finished_seq_ids=list(range(14))))
    assert [toks[i] for i in range(14)] == alone


def test_float_weights_fall_back_to_int8(tmp_path):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(0), "F32", tokenizer=True)
    r = ModelRunner(path, num_blocks=16, num_threads=1, quantization="auto")
    assert not isinstance(r.model.layers[0].qkv, GGUFLinear)
    assert np.isfinite(oracle.runner_last_logits(r, [1, 2, 3]).numpy()).all()


def test_prompt_rows_use_the_bfloat16_copy_and_decode_rows_the_blocks():
    lib = gguf_kernels.load()
    if lib is None:
        pytest.skip("no block kernel on this CPU (the torch path has no prefill copy)")
    w = blocks("Q4_1", 64, 96)
    fast, plain = GGUFLinear(w, torch.float32, lib, prefill_bf16=True), GGUFLinear(w, torch.float32, lib)
    x = torch.randn(PREFILL_MIN_ROWS + 5, 96, generator=torch.Generator().manual_seed(2))
    p = PREFILL_MIN_ROWS
    y = fast(x, p)
    # prompt rows: the file's numbers and the input rounded to bfloat16, products summed in
    # float32 and rounded to bfloat16 (on AMX tiles or by oneDNN)
    exact = x[:p].to(torch.bfloat16).double() @ w.dequantize().to(torch.bfloat16).double().T
    assert torch.equal(y[:p], y[:p].to(torch.bfloat16).float())  # bfloat16 numbers
    torch.testing.assert_close(y[:p].double(), exact, rtol=2 ** -8, atol=1e-5)
    if fast._gemm is None:
        bf16 = torch.nn.functional.linear(x[:p].to(torch.bfloat16), w.dequantize().to(torch.bfloat16)).float()
        assert torch.equal(y[:p], bf16)
    assert torch.equal(y[p:], plain(x[p:]))  # decode rows: exactly what the blocks give
    assert torch.equal(fast(x, p - 1), plain(x))  # too few prompt rows: all on the blocks
    assert not torch.equal(y[:p], plain(x)[:p])  # the copy is really used


def test_prefill_dtype_follows_the_cpu_unless_chosen():
    assert prefill_in_bfloat16("bfloat16", "cpu") and not prefill_in_bfloat16("float32", "cpu")
    assert not prefill_in_int8("auto", "cpu") and not prefill_in_int8("int16", "cpu")  # only if asked
    assert prefill_in_int8("int8", "cpu") == (gguf_kernels.load() is not None)
    assert not prefill_in_int8("int8", "cuda")
    assert prefill_in_bfloat16("auto", "cpu") == native_bfloat16()
    assert not prefill_in_bfloat16("auto", "cuda")
    with pytest.raises(ValueError, match="prefill_dtype"):
        prefill_in_bfloat16("float16", "cpu")
