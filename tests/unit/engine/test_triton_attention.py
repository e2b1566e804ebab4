"""The Triton paged decode-attention kernel (CUDA's decode path) against the torch gather
path it replaces, run on the CPU in Triton's interpreter (TRITON_INTERPRET=1); and the real
kernel compiled ahead of time for Hopper (sm_90) by Triton's bundled ptxas, no GPU needed.

Skipped where the `triton` package is not installed (it is a test dependency on Linux x86-64;
the CPU torch wheel does not bring it).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine.attention import AttentionMetadata, _decode, build_metadata

def _import_interpreted():
    """triton and services.engine.triton_attention imported with the interpreter on: every
    @triton.jit (triton's own tl.zeros etc. too) reads TRITON_INTERPRET when it decorates, so
    it must be set before triton is first imported. Returns the module, or a skip reason."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "triton was imported before this module without TRITON_INTERPRET=1"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules.pop("services.engine.triton_attention", None)
        return importlib.import_module("services.engine.triton_attention"), ""
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


_MODULE, _WHY = _import_interpreted()
pytestmark = pytest.mark.skipif(_MODULE is None and os.environ.get("CI") != "true", reason=_WHY or "")


@pytest.fixture(scope="module")
def kernel():
    """The interpreted module; TRITON_INTERPRET stays set while it runs (triton reads it again
    at the first launch)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _numpy2_scalar_shim()
    yield _MODULE
    if old is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = old


def _numpy2_scalar_shim():
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound
    with int(array), which NumPy 2 refuses; take the element instead (interpreter only)."""
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_tokenserve_shim", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._tokenserve_shim = True
    interp._patch_lang_tensor = patched


def scattered(ctx_lens, block_size, num_blocks, extra_columns=0, seed=0):
    """Decode rows over block tables spread across the cache (built directly: a row of context
    1, like a padded CUDA-graph row, is no decode to build_metadata). With extra_columns the
    second table returned is wider than any row needs, filled past each row's blocks with other
    (valid) ids, as the stale columns of a static buffer."""
    g = torch.Generator().manual_seed(seed)
    tables = [[(i * 7 + j * 5) % num_blocks for j in range(-(-ctx // block_size))]
              for i, ctx in enumerate(ctx_lens)]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(slots=torch.zeros(len(ctx_lens), dtype=torch.long),
                             decode_blocks=padded, decode_ctx=torch.tensor(ctx_lens))
    wide = torch.randint(0, num_blocks, (len(tables), width + extra_columns), generator=g)
    for r, t in enumerate(tables):
        wide[r, :len(t)] = torch.tensor(t)
    return meta, wide


CASES = [  # (heads, kv heads, head dim, context lengths, block size)
    (9, 3, 64, [2], 16),  # SmolLM2's heads
    (9, 3, 64, [1, 16, 17, 64, 65, 130], 16),  # tile and block edges
    (32, 8, 64, [200, 5, 64], 16),  # Llama-3.2-1B's heads
    (4, 2, 72, [33, 7], 8),  # a head size that is no power of two; 8-position blocks
    (8, 8, 64, [100], 32),  # no grouping
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, ctx_lens, block_size", CASES)
def test_kernel_matches_the_gather_reference(kernel, heads, kv_heads, head_dim, ctx_lens, block_size):
    g = torch.Generator().manual_seed(heads * head_dim + len(ctx_lens))
    nblk = 48
    cache_k = torch.randn(nblk, block_size, kv_heads, head_dim, generator=g)
    cache_v = torch.randn(nblk, block_size, kv_heads, head_dim, generator=g)
    meta, _ = scattered(ctx_lens, block_size, nblk)
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=g) * 3  # peaky softmax too
    scale = head_dim ** -0.5
    fast = kernel.paged_decode_attention(q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx, scale)
    ref = _decode(q, cache_k, cache_v, meta, scale, heads // kv_heads, None)
    assert fast.shape == ref.shape and fast.dtype == q.dtype
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-4)


def test_stale_table_columns_are_never_read(kernel):
    """A static (CUDA graph) table is wider than the rows need: the rest must not matter."""
    g = torch.Generator().manual_seed(3)
    cache_k = torch.randn(40, 16, 3, 64, generator=g)
    cache_v = torch.randn(40, 16, 3, 64, generator=g)
    q = torch.randn(3, 9, 64, generator=g)
    meta, wide = scattered([5, 40, 100], 16, 40, extra_columns=9)
    a = kernel.paged_decode_attention(q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx, 0.125)
    b = kernel.paged_decode_attention(q, cache_k, cache_v, wide, meta.decode_ctx, 0.125)
    assert torch.equal(a, b)


def test_float16_cache_and_strided_queries(kernel):
    """float16 K/V (16-bit dots, float32 accumulation) and q as a view of the fused QK tensor."""
    g = torch.Generator().manual_seed(5)
    cache_k = torch.randn(32, 16, 2, 64, generator=g).half()
    cache_v = torch.randn(32, 16, 2, 64, generator=g).half()
    qk = torch.randn(2, 8 + 2, 64, generator=g).half()  # [B, H + Hkv, D]
    q = qk[:, :8]  # not contiguous over rows
    meta, _ = scattered([20, 77], 16, 32)
    fast = kernel.paged_decode_attention(q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx, 0.125)
    ref = _decode(q.float().contiguous(), cache_k.float(), cache_v.float(), meta, 0.125, 4, None)
    assert fast.dtype == torch.float16
    assert torch.allclose(fast.float(), ref, atol=3e-3, rtol=3e-3)


def test_attend_uses_the_paged_kernel_for_decode_rows(kernel):
    """attention.attend hands decode rows to `paged` (as the model does on CUDA), prefill rows
    to SDPA, and the whole matches the reference."""
    from services.engine.attention import attend, write_kv

    g = torch.Generator().manual_seed(9)
    bs, nblk, h, hkv, d = 16, 32, 4, 2, 64
    cache_k = torch.zeros(nblk, bs, hkv, d)
    cache_v = torch.zeros(nblk, bs, hkv, d)
    hist = torch.randn(nblk * bs, hkv, d, generator=g)  # earlier positions of both sequences
    cache_k.view(-1, hkv, d).copy_(hist)
    cache_v.view(-1, hkv, d).copy_(hist.flip(0))
    spans = [(0, 5, [3]), (20, 1, [7, 8])]  # a 5-token prompt, then a decode at position 20
    meta = build_metadata(spans, bs, "cpu")
    q = torch.randn(6, h, d, generator=g)
    k = torch.randn(6, hkv, d, generator=g)
    v = torch.randn(6, hkv, d, generator=g)
    write_kv(cache_k, cache_v, k, v, meta.slots)
    calls = []

    def paged(*args):
        calls.append(args[0].shape[0])
        return kernel.paged_decode_attention(*args)

    fast = attend(q, k, v, cache_k, cache_v, meta, 0.125, None, paged)
    ref = attend(q, k, v, cache_k, cache_v, meta, 0.125, None)
    assert calls == [1]
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-4)


def test_bfloat16_cache_with_a_float32_query(kernel):
    """bfloat16 K/V converted as loaded (float32 dots). The bfloat16 x bfloat16 tensor-core
    dots of CUDA's default (bfloat16 compute) cannot run here: Triton's interpreter keeps
    bfloat16 as raw 16-bit integers in tl.dot; bench/gpu_suite.py checks them on the GPU."""
    g = torch.Generator().manual_seed(11)
    cache_k = torch.randn(16, 16, 3, 64, generator=g).bfloat16()
    cache_v = torch.randn(16, 16, 3, 64, generator=g).bfloat16()
    q = torch.randn(2, 9, 64, generator=g)
    meta, _ = scattered([40, 20], 16, 16)
    fast = kernel.paged_decode_attention(q, cache_k, cache_v, meta.decode_blocks, meta.decode_ctx, 0.125)
    ref = _decode(q, cache_k.float(), cache_v.float(), meta, 0.125, 3, None)
    assert fast.dtype == torch.float32
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-4)


_AOT = r'''
import json, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from services.engine import triton_attention as ta

out = {}
for qdt, kvdt, heads, kv_heads, f32 in [("bf16", "bf16", 9, 3, False), ("bf16", "bf16", 32, 8, False),
                                        ("fp32", "fp32", 9, 3, True), ("fp32", "fp16", 9, 3, True)]:
    sig = {"Q": f"*{qdt}", "K": f"*{kvdt}", "V": f"*{kvdt}", "TABLES": "*i64", "CTX": "*i64",
           "OUT": f"*{qdt}", "scale": "fp32"}
    strides = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_tb",
               "stride_ob", "stride_oh"]
    sig.update({s: "i32" for s in strides})
    const = dict(ta.launch_shape(heads, kv_heads, 64), BLOCK_SIZE=16, TILE_N=ta.TILE, F32_DOT=f32)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    # as the JIT specializes them at run time: 16-aligned pointers, strides divisible by 16
    aligned = ["Q", "K", "V", "TABLES", "CTX", "OUT", *strides]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn=ta._paged_decode_kernel, signature=sig, constexprs=const,
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32))
    cubin = Path(sys.argv[1]) / f"{qdt}-{kvdt}-{heads}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    sass = subprocess.run([str(nvdisasm), str(cubin)], capture_output=True, text=True).stdout
    out[f"{qdt}-{kvdt}-{heads}"] = {"hmma": sass.count("HMMA"), "ldg128": sass.count(".128")}
print(json.dumps(out))
'''


def test_kernel_compiles_for_hopper_with_tensor_cores(tmp_path):
    """The real (not interpreted) kernel compiled ahead of time for sm_90 by Triton's own
    ptxas, no GPU needed: every dtype variant builds; the bfloat16 one multiplies on tensor
    cores (HMMA) and loads K/V 16 bytes at a time."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=300, cwd=str(Path(__file__).resolve().parents[3]))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == {"bf16-bf16-9", "bf16-bf16-32", "fp32-fp32-9", "fp32-fp16-9"}
    for name in ("bf16-bf16-9", "bf16-bf16-32"):
        assert got[name]["hmma"] > 0 and got[name]["ldg128"] > 0, got


def test_model_decodes_through_the_kernel_as_on_cuda(kernel, tmp_path):
    """The model with the Triton kernel as its decode path (what LlamaModel picks on CUDA),
    eagerly and through the CUDA graph's body (packed rows, padded bucket, wide tables), gives
    the reference runner's greedy tokens."""
    from services.engine import cuda_graphs as cg
    from services.engine.interface import Batch, SamplingParams, SeqChunk
    from services.engine.runner import ModelRunner
    from tests.unit.engine import tiny_models as tm

    path = tm.write_gguf(tmp_path / "m.gguf", tm.random_weights(6))
    ref = ModelRunner(path, num_blocks=24, block_size=4, num_threads=1, kernels=False)
    fast = ModelRunner(path, num_blocks=24, block_size=4, num_threads=1, kernels=False)
    fast.model._paged = kernel.paged_decode_attention
    g = SamplingParams()
    prompts = {1: [5, 9, 3, 7, 1, 2], 2: [8, 8, 4], 3: [11, 12, 13, 14, 15, 16, 17, 18, 19]}
    tables = {1: [4, 9, 10, 11], 2: [0, 1, 3], 3: [17, 2, 6, 7, 8]}

    def run(r, graph_body: bool):
        out = r.execute(Batch([SeqChunk(s, p, 0, tables[s], True, g) for s, p in prompts.items()]))
        toks = {s: [out.sampled[s].token_id] for s in prompts}
        stage = cg.new_staging(4, 6, 4, 23)  # bucket 4 for 3 rows; block 23: scratch
        for step in range(6):
            chunks = [SeqChunk(s, [toks[s][-1]], len(p) + step, tables[s], True, g)
                      for s, p in prompts.items()]
            if graph_body:
                cg.pack(stage.numpy(), chunks, 4, 4, 23)
                with torch.inference_mode():
                    logits = cg.decode_step(r.model, r.kv, stage, torch.arange(4))[:3]
                for s, row in zip(prompts, logits.argmax(-1).tolist()):
                    toks[s].append(row)
            else:
                out = r.execute(Batch(chunks))
                for s in prompts:
                    toks[s].append(out.sampled[s].token_id)
        r.execute(Batch([], finished_seq_ids=list(prompts)))
        return toks

    expected = run(ref, False)
    assert run(fast, False) == expected
    assert run(fast, True) == expected
