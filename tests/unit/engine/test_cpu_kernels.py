"""The small AVX2 kernels against the torch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 49152])
def test_argmax_rows_follows_torch_rules(lib, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = 0.5  # all tied: the first index
    x[2, vocab // 2] = float("nan")  # NaN counts as the largest value
    x[2, -1] = float("nan")
    x[3, -1] = float("inf")
    x[3, 0] = float("inf")
    x[4] = float("-inf")
    assert torch.equal(cpu_kernels.argmax_rows(lib, x), torch.argmax(x, dim=-1))


def test_silu_mul_matches_torch(lib):
    gate_up = torch.randn(5, 2 * 100, generator=torch.Generator().manual_seed(1)) * 8
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(cpu_kernels.silu_mul(lib, gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_silu_mul_in_bfloat16_rounds_the_float32_result(lib):
    gate_up = (torch.randn(7, 2 * 1000, generator=torch.Generator().manual_seed(2)) * 8).to(torch.bfloat16)
    gate_up[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # 1000 % 8: a scalar tail too
    got = cpu_kernels.silu_mul(lib, gate_up)
    assert got.dtype == torch.bfloat16
    ref = cpu_kernels.silu_mul(lib, gate_up.float()).to(torch.bfloat16)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)  # NaNs' bits aside, equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 1000, 27, 5])  # 16-lane, 8-lane and scalar tails
def test_silu_mul_avx512_gives_the_avx2_bits(lib, dtype, inter):
    if "avx512_bf16" not in cpu_kernels.cpu_flags():
        pytest.skip("no AVX512-BF16 here: silu_mul runs its AVX2 build (the other tests)")
    gate_up = (torch.randn(6, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 8).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, float("inf")])
    outs = []
    for fn in (lib.silu_mul_avx2, lib.silu_mul_avx512, lib.silu_mul):
        out = torch.empty(6, inter, dtype=dtype)
        fn(gate_up.data_ptr(), out.data_ptr(), 6, inter, int(dtype == torch.bfloat16))
        outs.append(out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))
    assert torch.equal(outs[1].view(bits), outs[2].view(bits))  # silu_mul picks it here


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rmsnorm_takes_and_gives_bfloat16_with_float32_numbers(lib, delta_dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 576, generator=g) * 4
    w = torch.randn(576, generator=g)
    delta = None if delta_dtype is None else (torch.randn(9, 576, generator=g) * 4).to(delta_dtype)
    x_ref = x.clone()
    ref = cpu_kernels.add_rmsnorm(lib, x_ref, None if delta is None else delta.float(), w, 1e-5)
    got = cpu_kernels.add_rmsnorm(lib, x, delta, w, 1e-5, torch.bfloat16)
    assert torch.equal(x, x_ref)  # the residual stream is float32 either way
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    assert torch.allclose(ref, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_rope_write_kv_equals_torchs_rope_and_cache_writes(lib, cache_dtype):
    from services.engine.attention import write_kv
    from services.engine.loader import ModelConfig
    from services.engine.model import rope_tables

    g = torch.Generator().manual_seed(5)
    h, hkv, d, t = 6, 2, 64, 7
    cos, sin = rope_tables(ModelConfig(name="m", vocab_size=8, hidden_size=h * d, intermediate_size=8,
                                       num_layers=1, num_heads=h, num_kv_heads=hkv, head_dim=d,
                                       rms_eps=1e-5, rope_theta=10000.0, max_position=64,
                                       tie_embeddings=True))
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    positions = torch.tensor([0, 5, 6, 7, 30, 31, 63])
    slots = torch.tensor([3, 9, 10, 11, 40, 41, 62])
    caches = [torch.zeros(16, 4, hkv, d, dtype=cache_dtype) for _ in range(4)]

    ref = qkv.clone()
    qk = ref[:, :(h + hkv) * d].view(t, h + hkv, d)
    rotated = torch.addcmul(qk * cos[positions].unsqueeze(1), qk.roll(d // 2, -1), sin[positions].unsqueeze(1))
    write_kv(caches[0], caches[1], rotated[:, h:], ref[:, (h + hkv) * d:].view(t, hkv, d), slots)
    qk.copy_(rotated)

    cpu_kernels.rope_write_kv(lib, qkv, positions, cos, sin, slots, caches[2], caches[3], h, hkv, d)
    assert torch.equal(qkv, ref)  # rounded as torch rounds it
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
