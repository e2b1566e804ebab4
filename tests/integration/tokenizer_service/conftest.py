"""A real tokenizer service process on ephemeral ports, serving SmolLM2 and a tiny SentencePiece model."""
from __future__ import annotations

import grpc
import pytest

from controlplane.service_process import ServiceProcess
from tokenserve.runtime.ports import free_port
from tests.tiny_tokenizer import write_gguf
from tokenserve.models import default_model_path
from tokenserve.tokenizer.v1 import tokenizer_pb2_grpc

MODEL = "smollm2"
TINY = "tiny"
MAX_TEXT_BYTES = 4096
# A template that rejects non-alternating roles through raise_exception.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "<|user|>{{ m['content'] }}</s>{% endfor %}")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizer")
    tiny = write_gguf(tmp / "tiny.gguf")
    strict = write_gguf(tmp / "strict.gguf", chat_template=STRICT_TEMPLATE)
    lazy = write_gguf(tmp / "lazy.gguf")
    broken = tmp / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    port, metrics_port = free_port(), free_port()
    proc = ServiceProcess("services.tokenizer", [
        "--port", str(port), "--metrics-port", str(metrics_port),
        "--model", f"{MODEL}={default_model_path()}", "--model", f"{TINY}={tiny}",
        "--model", f"broken={broken}", "--model", f"strict={strict}", "--model", f"lazy={lazy}", "--max-text-bytes", str(MAX_TEXT_BYTES),
        "--max-batch-items", "8"], port, log_path=tmp / "tokenizer.log")
    proc.start()
    proc.metrics_port = metrics_port
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def channel(service):
    with grpc.insecure_channel(service.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return tokenizer_pb2_grpc.TokenizerServiceStub(channel)
