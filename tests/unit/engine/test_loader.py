"""Loading GGUF files and HF folders, and the clear errors for what cannot be served."""
from __future__ import annotations

import json

import pytest
import torch

from services.engine.loader import ModelLoadError, load_weights
from services.engine.runner import ModelRunner
from tests.unit.engine import tiny_models as tm


@pytest.fixture(scope="module")
def weights():
    return tm.random_weights(3)


@pytest.mark.parametrize("qtype, atol", [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 1e-2), ("Q4_1", 0.1)])
def test_gguf_dequantizes_and_unpermutes(tmp_path, weights, qtype, atol):
    loaded = load_weights(tm.write_gguf(tmp_path / "m.gguf", weights, qtype))
    t = loaded.tensors
    for i in range(tm.LAYERS):
        for ours, hf in (("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"), ("w_down", "mlp.down_proj")):
            src = weights[f"model.layers.{i}.{hf}.weight"]
            assert t[f"layers.{i}.{ours}"].dtype == torch.float32
            assert torch.allclose(t[f"layers.{i}.{ours}"], src, atol=atol, rtol=0)
    c = loaded.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (tm.LAYERS, tm.HEADS, tm.KV_HEADS, tm.HEAD_DIM)
    assert c.rope_theta == tm.THETA and c.max_position == tm.MAX_POS and not c.tie_embeddings
    assert c.eos_token_ids == (2,) and c.name == "tiny-llama"


def test_gguf_without_output_tensor_is_tied(tmp_path):
    w = tm.random_weights(3, tied=True)
    loaded = load_weights(tm.write_gguf(tmp_path / "m.gguf", w))
    assert loaded.config.tie_embeddings and "lm_head" not in loaded.tensors


def test_hf_folder(tmp_path, weights):
    loaded = load_weights(tm.write_hf(tmp_path / "hf", weights))
    assert torch.equal(loaded.tensors["layers.1.wk"], weights["model.layers.1.self_attn.k_proj.weight"])
    assert loaded.config.num_kv_heads == tm.KV_HEADS and loaded.config.eos_token_ids == (2,)


def test_progress_reports_every_tensor(tmp_path, weights):
    calls = []
    r = ModelRunner(tm.write_gguf(tmp_path / "m.gguf", weights), num_blocks=8,
                    progress=lambda done, total: calls.append((done, total)), num_threads=1)
    total = len(weights)
    assert calls == [(i, total) for i in range(1, total + 1)]
    assert r.load_seconds > 0


def expect_error(path, *words):
    with pytest.raises(ModelLoadError) as e:
        load_weights(path)
    assert e.value.path == str(path)
    for w in words:
        assert w in e.value.reason
    assert str(path) in str(e.value)


def test_unknown_gguf_architecture(tmp_path, weights):
    expect_error(tm.write_gguf(tmp_path / "m.gguf", weights, arch="mamba"), "unsupported architecture", "mamba")


def test_unsupported_quant_type(tmp_path, weights):
    expect_error(tm.write_gguf(tmp_path / "m.gguf", weights, raw_q_type="Q8_1"), "Q8_1", "blk.0.attn_q")


def test_truncated_gguf(tmp_path, weights):
    path = tm.write_gguf(tmp_path / "m.gguf", weights, "Q8_0")
    data = path.read_bytes()
    for cut in (len(data) // 2, 100, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        expect_error(bad)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    expect_error(bad, "corrupt")


def test_gguf_without_tokenizer(tmp_path, weights):
    expect_error(tm.write_gguf(tmp_path / "m.gguf", weights, tokenizer=False), "tokenizer")


def test_missing_path_and_wrong_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    other = tmp_path / "model.bin"
    other.write_bytes(b"\0" * 64)
    expect_error(other, "not a GGUF file")


def test_hf_folder_errors(tmp_path, weights):
    good = tm.write_hf(tmp_path / "a", weights)
    (good / "tokenizer.json").unlink()
    expect_error(good, "tokenizer.json")

    no_cfg = tm.write_hf(tmp_path / "b", weights)
    (no_cfg / "config.json").unlink()
    expect_error(no_cfg, "config.json")

    other = tm.write_hf(tmp_path / "c", weights, config=tm.hf_config(model_type="gpt_neox"))
    expect_error(other, "unsupported architecture", "gpt_neox")

    no_weights = tm.write_hf(tmp_path / "d", weights)
    (no_weights / "model.safetensors").unlink()
    expect_error(no_weights, "safetensors")

    corrupt = tm.write_hf(tmp_path / "e", weights)
    (corrupt / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json")
    expect_error(corrupt, "safetensors")

    bad_json = tm.write_hf(tmp_path / "f", weights)
    (bad_json / "config.json").write_text("{")
    expect_error(bad_json, "config.json")

    incomplete = tm.write_hf(tmp_path / "g", weights)
    cfg = tm.hf_config()
    del cfg["hidden_size"]
    (incomplete / "config.json").write_text(json.dumps(cfg))
    expect_error(incomplete, "hidden_size")


def test_missing_or_misshaped_tensor(tmp_path, weights):
    w = dict(weights)
    del w["model.layers.1.mlp.up_proj.weight"]
    expect_error(tm.write_hf(tmp_path / "a", w), "layers.1.w_up", "missing")
    w = dict(weights)
    w["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(3, tm.HIDDEN)
    expect_error(tm.write_hf(tmp_path / "b", w), "layers.0.wv", "shape")


def test_runner_rejects_bad_options(tmp_path, weights):
    path = tm.write_gguf(tmp_path / "m.gguf", weights)
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(path, dtype="float8")
    with pytest.raises(ValueError, match="quantization"):
        ModelRunner(path, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        ModelRunner(path, kv_cache_bytes=10, num_threads=1)


def test_a_state_dict_in_memory_loads_like_its_folder(tmp_path):
    """loaded_from_state_dict (benchmarks hand it a transformers model's weights) gives the
    same runner as the saved folder."""
    from services.engine.interface import Batch, SamplingParams, SeqChunk
    from services.engine.loader import hf_model_config, loaded_from_state_dict

    weights = tm.random_weights(5, tied=True)
    folder = tm.write_hf(tmp_path / "hf", weights, tied=True)
    cfg = hf_model_config(tm.hf_config(tied=True), "tiny")
    assert cfg.tie_embeddings and cfg.num_kv_heads == tm.KV_HEADS
    mem = loaded_from_state_dict(cfg, {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]})
    assert "lm_head" not in mem.tensors
    outs = []
    for src in (folder, mem):
        r = ModelRunner(src, num_blocks=8, num_threads=1)
        g = SamplingParams()
        outs.append(r.execute(Batch([SeqChunk(1, [3, 1, 4, 1, 5], 0, [0], True, g)])).sampled[1])
    assert outs[0] == outs[1]
    with pytest.raises(ModelLoadError, match="missing"):
        loaded_from_state_dict(cfg, {k: v for k, v in weights.items() if "layers.1." not in k})
