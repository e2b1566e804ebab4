"""Engine service configuration: one frozen dataclass, validated on construction.

Values found at run time (KV block count, context length, device) are reported by
GetInfo, never written back here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from tokenserve.runtime.config import check_endpoint, check_ports
from controlplane.etcd_client import EtcdCredentials
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
# --dtype: "auto" is bfloat16 on CUDA (half the weight bytes, tensor cores) and float32 on
# the CPU (the GGUF kernels and the exact mode compute in float32).
COMPUTE_DTYPES = ("auto", *DTYPES)
QUANTIZATIONS = ("auto", "none", "int8")  # what each means: services/engine/quant.py
PREFILL_DTYPES = ("auto", "bfloat16", "float32", "int16", "int8")  # likewise
DECODE_DTYPES = ("auto", "bfloat16", "float32", "int16")  # likewise


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    model_name: str = "smollm2-135m-instruct"
    version: str = "q4_1"
    host: str = "127.0.0.1"
    port: int = 50053
    # None: no /metrics endpoint.
    metrics_port: int | None = 9103
    device: str = "cpu"
    # Activations and dense weights; "auto": resolve_dtype(dtype, device).
    dtype: str = "auto"
    # The default is the fast one: a GGUF file's own quantized blocks (int8 for float weights).
    # "none" with float32 (and a float32 KV cache) is the bit-faithful exact mode (--exact).
    quantization: str = "auto"
    # What the KV cache stores (None: float16 when quantized, else dtype). float16 halves its
    # memory and decode reads.
    kv_cache_dtype: str | None = None
    # Prompt rows of a step: "auto" multiplies them in bfloat16 where the CPU does so natively
    # (a bfloat16 copy of the GGUF weights, 2 bytes a weight), else as the decode rows' int16
    # where this CPU's integer multiplies are the faster (quant.prefill_in_int16), else
    # "float32": the file's blocks. "int8" (only if chosen): the 4-bit blocks' prompt rows but
    # q, k, v with the input rounded to int8 per block of 32, as llama.cpp does (faster, lossier).
    prefill_dtype: str = "auto"
    # Every other row the GGUF blocks are multiplied with (decode rows, drafts, short prompt
    # chunks): "auto" is bfloat16 arithmetic where the kernels have an AVX512-BF16 build for
    # this CPU (the blocks rounded to bfloat16 as they are read), else "int16" (the input in
    # 16-bit fixed point per block of 32, the file's exact weights); "float32": the file's
    # exact weights times the float32 input.
    decode_dtype: str = "auto"
    # CUDA: run every step op by op, without CUDA graphs, and without overlapping the host's
    # work with the device's (debugging); no effect on the CPU.
    eager: bool = False
    # CPU threads for torch (None: every core this process may use).
    threads: int | None = None
    # Most requests running at once (batch rows); more wait, up to max_waiting.
    max_concurrency: int = 64
    # Requests waiting beyond max_concurrency; the servicer refuses one more with
    # RESOURCE_EXHAUSTED.
    max_waiting: int = 256
    # Tokens computed per step across all requests (the chunked-prefill budget). While
    # requests decode, itl_target_ms keeps a step's prompt tokens far below it; a burst on an
    # idle engine is prefilled in steps this large (16 x 64 prompt tokens on 2 cores, A/B in
    # one process: first tokens 5% sooner and 5% more tokens/s than in steps of 256).
    max_batched_tokens: int = 1024
    # While requests decode, a step's prompt tokens are limited so it is expected to take at
    # most this long (learned from step timings); 0: only max_batched_tokens bounds them.
    itl_target_ms: float = 100.0
    # When nobody is streaming yet, prompts of a burst hold their first token until the whole
    # burst is prefilled (so it is prefilled in full steps and decodes as one batch), if the
    # learned cost says that takes at most this long; 0: never hold.
    burst_hold_ms: float = 15000.0
    # A prompt that has waited this long for its first token lifts itl_target_ms: steps
    # take prompt tokens up to max_batched_tokens until no such prompt is left (streams
    # stall for a long step rather than a latecomer waiting many short ones); 0: never.
    prompt_wait_ms: float = 1000.0
    block_size: int = 16
    # KV cache size; None: the runner sizes it from available memory.
    kv_cache_mb: int | None = None
    enable_prefix_caching: bool = True
    # Prompt-lookup speculative decoding (requests may opt out); most drafts per request-step.
    speculation: bool = True
    num_draft_tokens: int = 8
    # Power figure used for energy when no counter is readable (reported as estimated).
    watts: float = 15.0
    etcd_endpoints: tuple[str, ...] = ()
    # Meter host:port for the engine's own usage records (None: no records), and the SQLite
    # file holding them until the meter has them.
    meter: str | None = None
    spool_path: str = "var/engine-spool.db"
    # How durable a usage record is before the last message: "process" or "disk"
    # (tokenserve.spool.DURABILITIES).
    spool_durability: str = "process"
    # Externally reachable address registered in etcd (default host:port).
    advertise: str | None = None
    grace_seconds: float = 5.0
    drain_seconds: float = 1.0
    log_level: str = "info"
    # The meter's service token, sent on every meter call (None: the meter wants none).
    meter_token: str | None = field(default=None, repr=False)
    # TLS of its listeners and of the channels it opens (tokenserve.runtime.tls).
    tls: TlsConfig = PLAINTEXT
    # How it reaches etcd: TLS, client certificate, user/password (controlplane.etcd_client).
    etcd_credentials: EtcdCredentials = EtcdCredentials()

    def __post_init__(self):
        if not self.model_name or not self.version:
            raise ValueError("model_name and version must not be empty")
        check_ports(self.port, self.metrics_port)
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (optionally cuda:N), got {self.device!r}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        if self.decode_dtype not in DECODE_DTYPES:
            raise ValueError(f"decode_dtype must be one of {DECODE_DTYPES}, got {self.decode_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_concurrency < 1 or self.max_waiting < 0:
            raise ValueError("max_concurrency must be >= 1 and max_waiting >= 0")
        if self.max_batched_tokens < self.max_concurrency:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be >="
                             f" max_concurrency ({self.max_concurrency}): every running request"
                             " decodes one token per step")
        if not self.itl_target_ms >= 0:
            raise ValueError(f"itl_target_ms must be >= 0 (0 turns it off), got {self.itl_target_ms}")
        if not self.burst_hold_ms >= 0:
            raise ValueError(f"burst_hold_ms must be >= 0 (0 turns it off), got {self.burst_hold_ms}")
        if not self.prompt_wait_ms >= 0:
            raise ValueError(f"prompt_wait_ms must be >= 0 (0 turns it off), got {self.prompt_wait_ms}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError(f"kv_cache_mb must be >= 1, got {self.kv_cache_mb}")
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be in [1, 64], got {self.num_draft_tokens}")
        if self.watts <= 0:
            raise ValueError(f"watts must be > 0, got {self.watts}")
        for ep in self.etcd_endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd endpoint must be host:port, got {ep!r}")
        if self.meter is not None:
            check_endpoint("--meter", self.meter)
        if self.spool_durability not in ("process", "disk"):
            raise ValueError("spool_durability must be 'process' or 'disk'")
        if not self.spool_path:
            raise ValueError("spool_path must be a file path")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace_seconds and drain_seconds must be >= 0")


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype --dtype names on `device`: "auto" is bfloat16 on CUDA, float32 on the CPU."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"
