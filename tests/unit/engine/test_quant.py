"""Weight-only int8: the AVX2 kernel, the dequantize path and their agreement."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.quant import DenseLinear, Int8Linear, make_linear
from services.engine.runner import ModelRunner
from tests.unit.engine import tiny_models as tm


@pytest.fixture(scope="module")
def weight():
    return torch.randn(200, 96, generator=torch.Generator().manual_seed(0))


def dequantized(lin: Int8Linear) -> torch.Tensor:
    return lin.qweight.float() * lin.scale[:, None]


def test_quantization_error_is_within_half_a_step(weight):
    lin = Int8Linear(weight, torch.float32)
    step = lin.scale[:, None]
    assert lin.qweight.dtype == torch.int8
    assert ((dequantized(lin) - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 3, 6, 7, 16, 17, 64, 65, 300])
def test_int8_linear_matches_its_dequantized_weight(weight, rows):
    lin = Int8Linear(weight, torch.float32)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    assert torch.allclose(lin(x), F.linear(x, dequantized(lin)), atol=1e-3, rtol=1e-4)


def test_kernel_builds_on_this_machine():
    if not cpu_kernels._cpu_has_avx2_fma_f16c():
        pytest.skip("CPU without AVX2/FMA: the torch path is used")
    assert cpu_kernels.load() is not None


def test_a_changed_kernel_header_is_a_new_build(tmp_path, monkeypatch):
    """A kernel's cached library is keyed by its source and the headers beside it: editing
    kernels/*.h (shared by two sources) rebuilds both rather than reusing a stale library."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text('#include "v.h"\nint value(void) { return V; }\n')
    (src / "v.h").write_text("#define V 1\n")
    monkeypatch.setattr(cpu_kernels, "KERNEL_DIR", src)
    first = cpu_kernels.build("k.c", [], tmp_path / "cache")
    assert cpu_kernels.build("k.c", [], tmp_path / "cache") == first  # cached
    (src / "v.h").write_text("#define V 2\n")
    second = cpu_kernels.build("k.c", [], tmp_path / "cache")
    assert second != first
    assert ctypes.CDLL(str(first)).value() == 1 and ctypes.CDLL(str(second)).value() == 2


def test_kernel_and_fallback_agree(weight):
    lin = Int8Linear(weight, torch.float32)
    if lin._lib is None:
        pytest.skip("kernel unavailable here")
    fallback = Int8Linear(weight, torch.float32, kernels=False)
    assert torch.equal(lin.qweight, fallback.qweight)  # packing loses nothing
    for rows in (2, 30):
        x = torch.randn(rows, 96)
        assert torch.allclose(lin(x), fallback(x), atol=1e-3, rtol=1e-4)


def test_kernel_row_results_do_not_depend_on_the_batch(weight):
    """Every tile shape (6, 3, 2 or 1 rows) sums in the same order: a decode's output is
    bit-identical whatever else is in the batch, prefill chunks included."""
    lin = Int8Linear(weight, torch.float32)
    if lin._lib is None:
        pytest.skip("kernel unavailable here")
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(5))
    full = lin(x)
    for m in (1, 2, 3, 4, 5, 6, 13, 64):
        assert torch.equal(lin(x[:m]), full[:m])
    assert torch.equal(lin(x[40:41]), full[40:41])


@pytest.mark.parametrize("out_features, in_features", [(8, 40), (97, 33), (200, 96)])
def test_any_shape_matches_its_dequantized_weight(out_features, in_features):
    """Packed weights are padded to whole 96-channel groups; only the real outputs come back."""
    lin = Int8Linear(torch.randn(out_features, in_features), torch.float32)
    for rows in (1, 2, 7):
        x = torch.randn(rows, in_features)
        y = lin(x)
        assert y.shape == (rows, out_features)
        assert torch.allclose(y, F.linear(x, dequantized(lin)), atol=1e-4)


def test_without_kernels_the_torch_path_is_used(weight):
    lin = Int8Linear(weight, torch.float32, kernels=False)
    assert lin._lib is None
    x = torch.randn(3, 96)
    assert torch.allclose(lin(x), F.linear(x, dequantized(lin)), atol=1e-4)


def test_make_linear_switch(weight):
    assert isinstance(make_linear(weight, quantization="none", dtype=torch.float32, device="cpu"), DenseLinear)
    assert isinstance(make_linear(weight, quantization="int8", dtype=torch.float32, device="cpu"), Int8Linear)
    with pytest.raises(ValueError, match="quantization"):
        make_linear(weight, quantization="nf4", dtype=torch.float32, device="cpu")


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    table = list(range(-(-(len(prompt) + n) // runner.block_size)))
    g = SamplingParams()
    out = [runner.execute(Batch([SeqChunk(1, prompt, 0, table, True, g)])).sampled[1].token_id]
    for i in range(n - 1):
        out.append(runner.execute(Batch([SeqChunk(1, [out[-1]], len(prompt) + i, table, True, g)])).sampled[1].token_id)
    runner.execute(Batch([], finished_seq_ids=[1]))
    return out


@pytest.mark.parametrize("dtype, quant", [("float32", "int8"), ("bfloat16", "none"), ("bfloat16", "int8")])
def test_reduced_precision_runners_mostly_agree_with_float32(tmp_path, dtype, quant):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(4))
    ref = ModelRunner(path, num_blocks=32, num_threads=1)
    other = ModelRunner(path, num_blocks=32, dtype=dtype, quantization=quant, num_threads=1)
    assert other.dtype == dtype and other.quantization == quant
    prompt = [(i * 11) % tm.VOCAB for i in range(20)]
    a, b = greedy(ref, prompt, 16), greedy(other, prompt, 16)
    assert a[:4] == b[:4]


@pytest.mark.parametrize("kernels", [True, False])
def test_float16_kv_cache_mostly_agrees_and_holds_twice_the_blocks(tmp_path, kernels):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(4))
    ref = ModelRunner(path, kv_cache_bytes=1 << 20, num_threads=1)
    half = ModelRunner(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16", num_threads=1,
                       kernels=kernels)
    assert half.kv.k[0].dtype == torch.float16 and half.kv_cache_dtype == "float16"
    assert half.num_blocks == 2 * ref.num_blocks
    prompt = [(i * 11) % tm.VOCAB for i in range(40)]  # > 2 blocks: decodes read several
    a, b = greedy(ref, prompt, 16), greedy(half, prompt, 16)
    assert a[:4] == b[:4]


def test_unknown_kv_cache_dtype_is_refused(tmp_path):
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(4))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelRunner(path, num_blocks=8, kv_cache_dtype="int4")


def test_float16_kv_cache_chunked_prefill_reads_the_cache(tmp_path):
    """A prompt prefilled in two chunks attends to the first chunk's float16 K/V."""
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(4))
    runner = ModelRunner(path, num_blocks=16, kv_cache_dtype="float16", num_threads=1)
    prompt = [(i * 7) % tm.VOCAB for i in range(24)]
    g = SamplingParams()
    whole = runner.execute(Batch([SeqChunk(1, prompt, 0, [0, 1], True, g)])).sampled[1].token_id
    runner.execute(Batch([SeqChunk(2, prompt[:10], 0, [2, 3], False, g)]))
    chunked = runner.execute(Batch([SeqChunk(2, prompt[10:], 10, [2, 3], True, g)])).sampled[2].token_id
    assert chunked == whole


def test_dtype_auto_runs_float32_on_the_cpu(tmp_path):
    """--dtype auto (the service default) is today's CPU behaviour: float32 compute, and the
    same tokens as an explicit float32 runner."""
    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(4))
    auto = ModelRunner(path, num_blocks=32, dtype="auto", num_threads=1)
    ref = ModelRunner(path, num_blocks=32, dtype="float32", num_threads=1)
    assert auto.dtype == "float32" and auto.kv_cache_dtype == ref.kv_cache_dtype
    prompt = [(i * 5) % tm.VOCAB for i in range(12)]
    assert greedy(auto, prompt, 8) == greedy(ref, prompt, 8)
