"""A decode step's layers in one C call each (cpu_kernels.DecodeLayers) give the same bits as
forward's layer-by-layer Python: logits, KV cache writes and the between-layers hook alike."""
from __future__ import annotations

import ctypes

import pytest
import torch

from services.engine import gguf_kernels
from services.engine.attention import build_metadata
from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner
from tests.unit.engine import tiny_models as tm

BS = 4


def runner_for(tmp_path, qtype: str, decode_dtype: str) -> ModelRunner:
    path = tm.write_gguf(tmp_path / f"tiny-{qtype}.gguf", tm.random_weights(5), qtype)
    return ModelRunner(path, quantization="auto", block_size=BS, num_blocks=64, num_threads=2, seed=0,
                       decode_dtype=decode_dtype)


def decode_step(runner: ModelRunner, hook_calls: list, c_path: bool):
    """Three sequences prefilled, then one decode-only forward: two one-token rows and a
    speculative chunk of four rows. Returns (logits, K and V of every layer)."""
    model = runner.model
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [[(i * 7 + s) % tm.VOCAB for i in range(n)] for s, n in enumerate((5, 9, 6))]
    runner.execute(Batch([SeqChunk(s, p, 0, tables[s], False, SamplingParams())
                          for s, p in enumerate(prompts)]))
    spans = [(5, 1, tables[0], True), (9, 1, tables[1], True), (6, 4, tables[2], True)]
    ids = [3, 17, 40, 41, 42, 43]
    positions = [5, 9, 6, 7, 8, 9]
    meta = build_metadata(spans, BS, "cpu")
    if not c_path:
        model._c_layers = lambda kv: None
    try:
        with torch.inference_mode():
            logits = model.forward(torch.tensor(ids), torch.tensor(positions), meta, runner.kv,
                                   torch.arange(len(ids)), lambda done, total: hook_calls.append((done, total)))
    finally:
        model.__dict__.pop("_c_layers", None)
    return logits, [t.clone() for t in runner.kv.k + runner.kv.v]


@pytest.mark.parametrize("qtype,decode_dtype", [("Q4_1", "auto"), ("Q8_0", "auto"), ("Q4_0", "float32")])
def test_c_decode_layers_give_the_same_bits_as_python(lib, tmp_path, qtype, decode_dtype):
    runner = runner_for(tmp_path, qtype, decode_dtype)
    c_calls, py_calls = [], []
    c_logits, c_cache = decode_step(runner, c_calls, c_path=True)
    assert runner.model._c_plan is not None  # the C layers ran
    py_logits, py_cache = decode_step(runner, py_calls, c_path=False)
    assert torch.equal(c_logits, py_logits)
    assert all(torch.equal(a, b) for a, b in zip(c_cache, py_cache))
    assert c_calls == py_calls == [(1, tm.LAYERS)]


def test_the_interleaved_kernel_is_what_the_c_layers_call(lib, tmp_path):
    """Where the CPU has AVX512-BF16, decode rows of Q4_1 run on the interleaved kernel, in C
    as in Python."""
    il = gguf_kernels.load_interleaved()
    if il is None:
        pytest.skip("no AVX512-BF16 here: the interleaved kernel is not built")
    runner = runner_for(tmp_path, "Q4_1", "auto")
    fn, _, w, _, _ = runner.model.layers[0].qkv.decode_kernel()
    amx = gguf_kernels.interleaved_amx(il)
    assert fn == ctypes.cast(il.gguf_linear_il16_amx if amx else il.gguf_linear_il16, ctypes.c_void_p).value
    assert w == runner.model.layers[0].qkv._interleaved.data_ptr()
    # and its Q/K/V multiply prefetches the K/V rows the attention reads next (VDPBF16PS: bound
    # by its multiplies; the AMX kernel prefetches none)
    decode_step(runner, [], c_path=True)
    assert runner.model._c_plan._model.prefetch_next == (None if amx else ctypes.cast(
        il.gguf_il16_prefetch_next, ctypes.c_void_p).value)
    # on AMX tiles the MLP's gate/up multiply gives silu(gate) * up itself (no silu_mul pass)
    swiglu = runner.model._c_plan._layers[0].swiglu
    assert swiglu.fn == (ctypes.cast(il.gguf_linear_il16_amx_swiglu, ctypes.c_void_p).value if amx else None)
    assert swiglu.w == (runner.model.layers[0].gate_up._interleaved.data_ptr() if amx else None)


def test_rows_handed_to_the_interleaved_kernel_change_nothing_it_computes(tmp_path):
    il = gguf_kernels.load_interleaved()
    if il is None:
        pytest.skip("no AVX512-BF16 here: the interleaved kernel is not built")
    runner = runner_for(tmp_path, "Q4_1", "auto")
    lin = runner.model.layers[0].gate_up
    x = torch.randn(16, lin.weight.shape[1], generator=torch.Generator().manual_seed(3))
    plain = lin(x)
    rows = (ctypes.c_char_p * 3000)(*[ctypes.cast(runner.kv.k[0].data_ptr() + 64 * i, ctypes.c_char_p)
                                      for i in range(3000)])
    il.gguf_il16_prefetch_next(rows, ctypes.c_int64(3000), ctypes.c_int64(2))
    assert torch.equal(lin(x), plain)


def test_the_k_v_prefetch_changes_no_bit_of_a_decode_step(lib, tmp_path):
    il = gguf_kernels.load_interleaved()
    if il is None or gguf_kernels.interleaved_amx(il):
        pytest.skip("no VDPBF16PS interleaved kernel here (no AVX512-BF16, or AMX takes the decode rows)")
    with_prefetch, without = runner_for(tmp_path, "Q4_1", "auto"), runner_for(tmp_path, "Q4_1", "auto")
    without.model.prefetch_kv = False
    got, ref = decode_step(with_prefetch, [], c_path=True), decode_step(without, [], c_path=True)
    assert with_prefetch.model._c_plan._model.prefetch_next and not without.model._c_plan._model.prefetch_next
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_steps_with_prompt_rows_stay_in_python(lib, tmp_path):
    runner = runner_for(tmp_path, "Q8_0", "auto")
    table = [0, 1, 2]
    runner.execute(Batch([SeqChunk(1, [5, 6, 7, 8, 9], 0, table, False, SamplingParams())]))
    assert runner.model._c_plan is None


def generate(runner: ModelRunner, sampling: list[SamplingParams], steps: int = 4) -> list[list[int]]:
    """Three prompts prefilled, then `steps` decode steps, each sequence with its own
    settings; every token each sampled (a speculative chunk of two drafts in the second step)."""
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [[(i * 5 + s) % tm.VOCAB for i in range(n)] for s, n in enumerate((5, 8, 3))]
    out = runner.execute(Batch([SeqChunk(s, p, 0, tables[s], True, sampling[s]) for s, p in enumerate(prompts)]))
    tokens = [[out.sampled[s].token_id] for s in range(3)]
    for step in range(steps):
        chunks = []
        for s in range(3):
            pos = len(prompts[s]) + len(tokens[s]) - 1
            drafts = [7, 8] if step == 1 and s == 2 else []
            chunks.append(SeqChunk(s, [tokens[s][-1], *drafts], pos, tables[s], True, sampling[s],
                                   prompt_token_ids=prompts[s], output_token_ids=list(tokens[s]),
                                   num_draft_tokens=len(drafts)))
        out = runner.execute(Batch(chunks))
        for s in range(3):
            tokens[s] += [t.token_id for t in out.accepted.get(s, [])] + [out.sampled[s].token_id]
    return tokens


def test_greedy_steps_take_the_lm_heads_argmax_and_the_same_tokens(lib, tmp_path, monkeypatch):
    """Where the lm_head has a fused argmax (AMX tiles), a step whose rows are all plain
    greedy takes its tokens from it, not from the logits: the same tokens as a runner that
    samples from the logits; a step with any row that needs the logits (a penalty, logprobs,
    temperature) does not use it."""
    from services.engine.quant import GGUFLinear
    calls = []
    fused = GGUFLinear.greedy_rows
    monkeypatch.setattr(GGUFLinear, "greedy_rows", lambda self, x: calls.append(x.shape[0]) or fused(self, x))
    il = gguf_kernels.load_interleaved()
    amx = gguf_kernels.interleaved_amx(il)
    runner = runner_for(tmp_path, "Q4_1", "auto")
    assert runner._greedy_head == amx
    plain = runner_for(tmp_path, "Q4_1", "auto")
    plain._greedy_head = False  # always the logits
    greedy = [SamplingParams()] * 3
    want = generate(plain, greedy)
    assert not calls
    assert generate(runner, greedy) == want
    assert calls == ([3, 3, 5, 3, 3] if amx else [])  # every step: one row a sequence, drafts too
    calls.clear()
    for needs_logits in (SamplingParams(logprobs=True), SamplingParams(repetition_penalty=1.3),
                         SamplingParams(temperature=0.8, seed=1)):
        mixed = [SamplingParams(), needs_logits, SamplingParams()]
        assert generate(runner, mixed, steps=2)[0] == want[0][:3]
        assert not calls
