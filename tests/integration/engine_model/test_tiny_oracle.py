"""A tiny random Llama, saved by transformers as a safetensors folder (and as GGUF files),
against transformers' own forward: logits agree and greedy decoding matches token for token."""
from __future__ import annotations

import pytest
import torch

from services.engine.runner import ModelRunner
from tests.integration.engine_model import oracle
from tests.unit.engine import tiny_models as tm

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 33, 17], [1] + list(range(40, 90)), [7] * 3 + [60, 61, 62, 2, 15],
           [(i * 37) % tm.VOCAB for i in range(300)]]


def build_hf(tied: bool, rope_scaling: dict | None = None):
    cfg = transformers.LlamaConfig(
        vocab_size=tm.VOCAB, hidden_size=tm.HIDDEN, intermediate_size=tm.INTER,
        num_hidden_layers=tm.LAYERS, num_attention_heads=tm.HEADS, num_key_value_heads=tm.KV_HEADS,
        max_position_embeddings=tm.MAX_POS, rms_norm_eps=tm.EPS, rope_theta=tm.THETA,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rope_scaling=rope_scaling)
    model = transformers.LlamaForCausalLM(cfg).eval()
    weights = tm.random_weights(5, tied=tied)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if tied:
        model.tie_weights()
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["separate_head", "tied"])
def pair(request, tmp_path_factory):
    """(HF model, our runner loaded from the folder HF saved)."""
    model = build_hf(tied=request.param)
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tm.tokenizer_json())
    return model, ModelRunner(folder, block_size=8, num_blocks=128, num_threads=1, quantization="none")


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "range", "repeats", "long"])
def test_safetensors_greedy_matches_transformers(pair, prompt):
    model, runner = pair
    ours = oracle.runner_greedy(runner, prompt, 32, prefill_chunk=37)
    assert ours == oracle.hf_greedy_no_eos(model, prompt, 32)


def test_safetensors_logits_agree(pair):
    model, runner = pair
    for prompt in PROMPTS:
        ours = oracle.runner_last_logits(runner, prompt)
        theirs = oracle.hf_last_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_gguf_files_match_transformers_loading_them(tmp_path, qtype):
    """gguf's own writer makes the file; transformers' GGUF loader is the oracle."""
    name = f"tiny.{qtype}.gguf"
    tm.write_gguf(tmp_path / name, tm.random_weights(5), qtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=name,
                                                              dtype=torch.float32).eval()
    runner = ModelRunner(tmp_path / name, block_size=8, num_blocks=64, num_threads=1, quantization="none")
    for prompt in PROMPTS:
        ours = oracle.runner_last_logits(runner, prompt)
        theirs = oracle.hf_last_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max().item()
    assert oracle.runner_greedy(runner, PROMPTS[3], 24) == oracle.hf_greedy_no_eos(model, PROMPTS[3], 24)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = build_hf(tied=False, rope_scaling=scaling)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tm.tokenizer_json())
    runner = ModelRunner(tmp_path, block_size=8, num_blocks=64, num_threads=1, quantization="none")
    prompt = PROMPTS[3]
    assert torch.allclose(oracle.runner_last_logits(runner, prompt), oracle.hf_last_logits(model, prompt),
                          atol=1e-4, rtol=1e-4)
