"""Fixtures: the default model's tokenizer (ours, and transformers' as the oracle)."""
from __future__ import annotations

import pytest

from tokenserve.models import default_model_path
from tokenserve.tokenization import ModelTokenizer, load_model_tokenizer


@pytest.fixture(scope="session")
def smollm() -> ModelTokenizer:
    return load_model_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' tokenizer for the same GGUF, with SmolLM2's own pre-tokenizer.

    transformers' GGUF loader does not know llama.cpp's "smollm" pre-tokenizer name and falls
    back to GPT-2's regex; SmolLM2's tokenizer.json (and llama.cpp) split every digit first.
    We follow the model's own tokenizer; test_exactness pins down the one place they differ.
    """
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.fixture(scope="session")
def hf_smollm_unpatched():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
