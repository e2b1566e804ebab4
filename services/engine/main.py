"""`python -m services.engine`: flags -> EngineConfig -> gRPC server + step thread.

Start-up order, so launchers can watch: the gRPC server binds first with health
NOT_SERVING, the model loads on the step thread (progress in the log), then health goes
SERVING and the engine registers in etcd (when --etcd-endpoints is given). SIGTERM: health
NOT_SERVING, drain, in-flight streams finish within the grace period, registration revoked,
step thread stopped, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import sys
from pathlib import Path

from services.engine import isa
from services.engine.block_manager import BlockManager
from services.engine.config import COMPUTE_DTYPES, DECODE_DTYPES, PREFILL_DTYPES, EngineConfig
from services.engine.energy import cuda_device_uuid, energy_source
from services.engine.engine_core import EngineCore, text_stream_factory
from services.engine.engine_loop import AsyncEngine
from services.engine.load import LoadPublisher, LoadWindow, PowerMeter, engine_sampler
from services.engine.metrics import EngineMetrics
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.servicer import SERVICE_NAME, EngineServicer, ModelInfo
from services.engine.speculation import SpeculationConfig
from tokenserve.engine.v1 import engine_pb2_grpc
from tokenserve.models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, default_model_path
from tokenserve.runtime.logging import configure_logging, get_logger
from tokenserve.runtime.server import GrpcServer, Registration, ServerOptions
from tokenserve.runtime.service_token import METER_TOKEN_ENV
from tokenserve.runtime.config import add_server_args
from controlplane.etcd_client import (ETCD_PASSWORD_ENV, add_etcd_auth_args,
                                      etcd_credentials_from_args)
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.tls import tls_from_args
from tokenserve.spool import DURABILITIES

log = get_logger(component="engine.main")


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser(prog="python -m services.engine",
                                description="tokenserve engine: serves one model version over gRPC")
    add_server_args(p, port=50053, metrics_port=9103)
    p.add_argument("--model-path", type=Path, default=None,
                   help="GGUF file or Hugging Face folder (default: the bundled SmolLM2)")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--version", default=DEFAULT_MODEL_VERSION)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES,
                   help="activations and dense weights: auto (default) is bfloat16 on CUDA and"
                        " float32 on the CPU")
    p.add_argument("--quantization", default="auto",
                   help="auto (default): a GGUF file's own quantized blocks, multiplied as they are"
                        " (int8 for float weights) | int8: every weight as per-channel int8 |"
                        " none: dense weights in --dtype")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="float32 | float16 | bfloat16 for the KV cache (default: float16 when"
                        " quantized, else --dtype); float16 halves its memory and what decode"
                        " attention reads")
    p.add_argument("--prefill-dtype", default="auto", choices=PREFILL_DTYPES,
                   help="prompt rows of a step: auto (default) multiplies them in bfloat16 where"
                        " the CPU does so natively (AMX or AVX512-BF16; keeps a bfloat16 copy of"
                        " the GGUF weights), else int16 where the decode rows take it and it is"
                        " the faster on this CPU (AVX2-only CPUs but AMD Zen 1/2), else float32"
                        " on the file's own blocks; int8 (never chosen by auto): Q4_0/Q4_1 prompt"
                        " rows but q/k/v with the input rounded to int8 per block of 32, as"
                        " llama.cpp does: 1.5-1.7x the int16 prompt multiplies, ~5x bfloat16's"
                        " logit error")
    p.add_argument("--decode-dtype", default="auto", choices=DECODE_DTYPES,
                   help="the other rows (decodes, drafts, short prompt chunks), always multiplied"
                        " on the file's own blocks: auto (default) in bfloat16 arithmetic where the"
                        " CPU has AVX512-BF16 (the input rounded to bfloat16), else int16 (the"
                        " decode rows' input in 16-bit fixed point per block of 32, the file's"
                        " exact weights, products summed in integers); float32: the exact"
                        " dequantized weights times the float32 input")
    p.add_argument("--exact", action="store_true",
                   help="the bit-faithful mode: float32 dense weights, activations and KV cache"
                        " (same as --quantization none --dtype float32); slower")
    p.add_argument("--eager", action="store_true",
                   help="CUDA: run every step op by op instead of replaying decode steps from"
                        " CUDA graphs, and each step after the last one's tokens went out"
                        " (no host/device overlap); for debugging; no effect on the CPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: all cores available)")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=1024,
                   help="tokens per step (the prefill chunk bound)")
    p.add_argument("--itl-target-ms", type=float, default=100.0,
                   help="while requests decode, limit the prompt tokens computed beside them so"
                        " a step should take at most this long; 0: off")
    p.add_argument("--burst-hold-ms", type=float, default=15000.0,
                   help="when nobody is streaming yet, the prompts of a burst start streaming"
                        " together if their prefill is expected to take at most this long; 0: off")
    p.add_argument("--prompt-wait-ms", type=float, default=1000.0,
                   help="a prompt that has waited this long for its first token lifts"
                        " --itl-target-ms (steps take prompt tokens up to --max-batched-tokens"
                        " until none is left waiting that long); 0: off")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="KV cache size (default: sized from available memory)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-speculation", action="store_true",
                   help="never draft tokens by prompt lookup (requests may also opt out)")
    p.add_argument("--num-draft-tokens", type=int, default=8,
                   help="most draft tokens verified per request per step")
    p.add_argument("--watts", type=float, default=15.0,
                   help="power figure for energy (reported as estimated) when no counter is"
                        " readable: NVML on a CUDA device, else RAPL")
    p.add_argument("--etcd-endpoints", default="", help="host:port[,host:port...]")
    add_etcd_auth_args(p)
    p.add_argument("--meter", default=None,
                   help="meter host:port: the engine sends its own usage record of every"
                        " request there (default: none)")
    p.add_argument("--spool-durability", choices=DURABILITIES, default="process",
                   help="how durable a usage record is before the request's last message: process (survives a crash of the service; on disk within 50 ms) or disk (fsync first; concurrent requests share one)")
    p.add_argument("--spool", default="var/engine-spool.db",
                   help="SQLite file holding usage records until the meter has them")
    p.add_argument("--advertise", default=None, help="host:port registered in etcd")
    p.add_argument("--grace-seconds", type=float, default=5.0)
    p.add_argument("--drain-seconds", type=float, default=1.0)
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    if a.exact:
        if (a.quantization not in ("auto", "none") or a.dtype not in ("auto", "float32")
                or a.kv_cache_dtype not in (None, "float32") or a.prefill_dtype in ("bfloat16", "int16", "int8")
                or a.decode_dtype in ("bfloat16", "int16")):
            p.error("--exact is float32 without quantization: drop --quantization/--dtype/"
                    "--kv-cache-dtype/--prefill-dtype/--decode-dtype")
        a.quantization, a.dtype, a.kv_cache_dtype = "none", "float32", "float32"
    try:
        isa.cap()  # a bad TOKENSERVE_CPU_ISA is a usage error, not a crash at model load
        return EngineConfig(
            model_path=a.model_path or default_model_path(), model_name=a.model_name,
            version=a.version, host=a.host, port=a.port,
            metrics_port=a.metrics_port, device=a.device,
            dtype=a.dtype, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
            prefill_dtype=a.prefill_dtype, decode_dtype=a.decode_dtype, eager=a.eager, threads=a.threads,
            max_concurrency=a.max_concurrency, max_waiting=a.max_waiting,
            max_batched_tokens=a.max_batched_tokens, itl_target_ms=a.itl_target_ms,
            burst_hold_ms=a.burst_hold_ms, prompt_wait_ms=a.prompt_wait_ms,
            block_size=a.block_size, kv_cache_mb=a.kv_cache_mb,
            enable_prefix_caching=not a.no_prefix_caching, watts=a.watts,
            speculation=not a.no_speculation, num_draft_tokens=a.num_draft_tokens,
            etcd_endpoints=tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip()),
            meter=a.meter, spool_path=a.spool, spool_durability=a.spool_durability,
            advertise=a.advertise, grace_seconds=a.grace_seconds, drain_seconds=a.drain_seconds,
            log_level=a.log_level, meter_token=os.environ.get(METER_TOKEN_ENV) or None,
            tls=tls_from_args(a),
            etcd_credentials=etcd_credentials_from_args(a, os.environ.get(ETCD_PASSWORD_ENV)))
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    except ServiceError as e:
        p.error(e.message)


def build_core(config: EngineConfig, window: LoadWindow | None = None) -> EngineCore:
    """Runs on the step thread: every torch call (loading included) happens there. `window`
    gets the latency and token observations the load reports are made of."""
    from services.engine.runner import ModelRunner  # torch: only on the step thread's path
    from tokenserve.tokenization import load_model_tokenizer

    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(1, total)
        if pct // 5 != last[0] // 5 or done == total:
            last[0] = pct
            log.info("model_load_progress", done=done, total=total, percent=pct)

    log.info("model_loading", path=str(config.model_path), device=config.device, dtype=config.dtype,
             cpu_isa=isa.cap())
    runner = ModelRunner(
        config.model_path, device=config.device, dtype=config.dtype,
        quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
        prefill_dtype=config.prefill_dtype, decode_dtype=config.decode_dtype,
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_mb * 2**20 if config.kv_cache_mb else None,
        max_num_seqs=config.max_concurrency, progress=progress, num_threads=config.threads,
        cuda_graphs=not config.eager)
    tokenizer = load_model_tokenizer(config.model_path)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=config.max_concurrency,
                        max_num_batched_tokens=config.max_batched_tokens,
                        max_model_len=runner.max_context,
                        itl_target_s=config.itl_target_ms / 1000,
                        burst_hold_s=config.burst_hold_ms / 1000,
                        prompt_wait_s=config.prompt_wait_ms / 1000,
                        speculation=SpeculationConfig(enabled=config.speculation,
                                                      num_draft_tokens=config.num_draft_tokens,
                                                      row_tile=runner.decode_row_tile),
                        # keep ~1% free so running requests can grow without preemption
                        admission_reserve_blocks=max(1, runner.num_blocks // 100)),
        BlockManager(runner.num_blocks, runner.block_size,
                     enable_prefix_caching=config.enable_prefix_caching),
        frozenset(runner.eos_token_ids))
    log.info("model_loaded", model=config.model_name, version=config.version,
             load_seconds=round(runner.load_seconds, 2), kv_blocks=runner.num_blocks,
             block_size=runner.block_size, max_context=runner.max_context)
    energy = engine_energy_source(config)
    log.info("energy_source", source=energy.name, estimated=energy.estimated)
    return EngineCore(runner, scheduler, text_stream=text_stream_factory(tokenizer),
                      energy=energy, observer=EngineMetrics(window),
                      overlap=runner.asynchronous and not config.eager)


def engine_energy_source(config: EngineConfig):
    """The best energy counter for the engine's device (energy.energy_source)."""
    on_cuda = config.device.split(":")[0] == "cuda"
    return energy_source(config.watts, device=config.device,
                         gpu_uuid=cuda_device_uuid(config.device) if on_cuda else None)


def model_info(config: EngineConfig, core: EngineCore) -> ModelInfo:
    r = core.runner
    return ModelInfo(model=config.model_name, version=config.version, max_context=r.max_context,
                     vocab_size=r.vocab_size, eos_token_ids=frozenset(r.eos_token_ids),
                     device=str(r.device), dtype=str(r.dtype), block_size=r.block_size,
                     num_blocks=r.num_blocks, max_concurrency=config.max_concurrency,
                     max_waiting=config.max_waiting)


async def serve(config: EngineConfig, *, build=build_core, ready: asyncio.Event | None = None) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code."""
    window = LoadWindow()
    engine = AsyncEngine(lambda: build(config, window))
    servicer = EngineServicer(engine)
    # its own energy source: the step thread's one splits joules between requests
    load = LoadPublisher(engine_sampler(engine, window, PowerMeter(engine_energy_source(config))))
    engine.on_change = load.poke
    registration: list = []  # the etcd handle, once registered
    usage_stop = _start_usage(config, engine) if config.meter else None

    async def stop_engine():
        task.cancel()  # a registration still retrying (etcd down) gives up
        for handle in registration:
            await handle.close()
        await asyncio.to_thread(engine.stop)
        if usage_stop is not None:
            await usage_stop()

    server = GrpcServer(
        "engine", [Registration(SERVICE_NAME, engine_pb2_grpc.add_EngineServiceServicer_to_server,
                                servicer)],
        ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                      grace_seconds=config.grace_seconds, drain_seconds=config.drain_seconds,
                      tls=config.tls),
        on_stop=[stop_engine], on_drain=[servicer.drain, load.close])
    await server.start(serving=False)
    engine.start()
    failed = []

    async def load_then_serve():
        try:
            await engine.wait_ready()
        except Exception as e:  # noqa: BLE001 - reported, then the process exits non-zero
            log.error("model_load_failed", exc_type=type(e).__name__, error=str(e)[:500])
            failed.append(e)
            server.request_stop()
            return
        servicer.info = model_info(config, engine.loop.core)
        servicer.load = load
        frozen = _freeze_loaded_objects()
        await server.set_serving(True)
        log.info("engine_ready", port=server.port, gc_frozen_objects=frozen,
                 **{k: v for k, v in vars(servicer.info).items() if k != "eos_token_ids"})
        if ready is not None:
            ready.set()
        if config.etcd_endpoints:
            await _register(config, server.port, servicer.info.max_context, registration)

    task = asyncio.create_task(load_then_serve())
    try:
        await server.run()
    finally:
        task.cancel()
    return 1 if failed else 0


def _freeze_loaded_objects() -> int:
    """Moves every object alive now (the model, torch, the libraries: ~200,000 of them) out of
    the garbage collector's reach for good and returns how many. They live as long as the
    process; unfrozen, each full collection walked them all: ~33 ms on a 2-core Xeon, a whole
    64-stream decode step (or three one-stream tokens) stalled whenever one came due. Frozen,
    collections walk only what requests allocate."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _start_usage(config: EngineConfig, engine: AsyncEngine):
    """Spool + sender of the engine's usage records; returns the stop function (flushes
    what it can, then closes)."""
    from services.engine.usage import EngineUsage, on_sent
    from tokenserve.meter.v1 import meter_pb2_grpc
    from tokenserve.runtime.channels import aio_channel
    from tokenserve.spool import SpoolSender, UsageSpool, send_usage

    spool = UsageSpool(config.spool_path, config.spool_durability)
    channel = aio_channel(config.meter, token=config.meter_token, tls=config.tls)
    stub = meter_pb2_grpc.MeterServiceStub(channel)
    sender = SpoolSender(spool, lambda records: send_usage(stub, records, 10.0),
                         on_sent=on_sent)
    usage = EngineUsage(config.model_name, config.version, spool, sender)
    engine.on_final = usage.record
    sender.start()
    log.info("usage_sender_started", meter=config.meter, spool=config.spool_path,
             pending=len(spool))

    async def stop():
        await sender.stop()
        spool.close()
        await channel.close()

    return stop


async def _register(config: EngineConfig, port: int, max_context: int, out: list) -> None:
    """Registers under a lease; retries while etcd is unreachable (serving goes on)."""
    from controlplane.registry import register_with_retry
    from controlplane.schema import EngineRegistration

    endpoint = config.advertise or f"{config.host}:{port}"
    reg = EngineRegistration(
        id=f"{config.model_name}-{config.version}-{socket.gethostname()}-{port}".replace("/", "-")[:128],
        endpoint=endpoint, model=config.model_name, version=config.version,
        capacity=config.max_concurrency, max_context=max_context)
    out.append(await register_with_retry(
        config.etcd_credentials.options(config.etcd_endpoints), "engines", reg))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging("engine", config.log_level)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
