"""Tokenizer service vs the raw `tokenizers` library, in the same run.

    python bench/tokenizer.py [--runs 5] [--batch 256] [--singles 300]

Corpus: real source code (the installed `transformers` package's .py files) cut into ~1 KB
prompts. Measured per run, then the median over runs:
  - single: one prompt per call, sequential. Raw = `Tokenizer.encode`; service = `Encode` RPC
    through a sync gRPC stub to a `python -m services.tokenizer` process on loopback; the two
    (and a bare `GetTokenizerInfo` RPC every other prompt) alternate prompt by prompt.
    Added latency = service p50 - raw p50; the bare RPC p50 is the gRPC round trip alone. The
    service encodes a prompt this long on every core at once (tokenserve/piece_encoding.py);
    the raw library's `encode` uses one thread, as an in-process caller gets it.
  - long: `--long` prompts of 16 KB, one per call, raw and service alternating (a long prompt
    is where encoding on every core shows); latency p50 of each.
  - batched: `--batch` prompts per call. Raw = `Tokenizer.encode_batch_fast`; service =
    `EncodeBatch`. Throughput in tokens/s; ratio = service / raw.
Writes bench/results/tokenizer.json and bench/results/tokenizer.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tokenserve.models import default_model_path  # noqa: E402
from tokenserve.runtime.ports import free_port  # noqa: E402
from tokenserve.tokenization import load_model_tokenizer  # noqa: E402
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb  # noqa: E402
from tokenserve.tokenizer.v1 import tokenizer_pb2_grpc  # noqa: E402

MODEL = "smollm2-135m-instruct"
RESULTS = ROOT / "bench" / "results"
LONG_BYTES = 16 * 1024


def code_prompts(n: int, size: int = 1024) -> list[str]:
    import transformers
    files = sorted(Path(transformers.__file__).parent.rglob("*.py"))
    prompts: list[str] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text) - size, size):
            prompts.append(text[start:start + size])
            if len(prompts) == n:
                return prompts
    return prompts


def start_service(port: int, workers: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--port", str(port), "--metrics-port", "-1",
         "--workers", str(workers), "--preload", "--log-level", "warning"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("tokenizer service exited during start")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return proc
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("tokenizer service not serving after 120 s")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def one_run(backend, stub, prompts: list[str], batch: list[str], long: list[str]) -> dict:
    # single: raw library, service and a bare RPC interleaved prompt by prompt, so the
    # machine's drift (a shared host) hits all three alike
    lat_raw, lat_svc, lat_rpc, tokens, tokens_svc = [], [], [], 0, 0
    info = pb.GetTokenizerInfoRequest(model=MODEL)
    for i, p in enumerate(prompts):
        t = time.perf_counter()
        tokens += len(backend.encode(p).ids)
        lat_raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        tokens_svc += len(stub.Encode(pb.EncodeRequest(model=MODEL, text=p)).token_ids)
        lat_svc.append(time.perf_counter() - t)
        if i % 2 == 0:
            t = time.perf_counter()
            stub.GetTokenizerInfo(info)
            lat_rpc.append(time.perf_counter() - t)
    assert tokens == tokens_svc, "service and library disagree"
    lat_raw_long, lat_svc_long = [], []
    for p in long:
        t = time.perf_counter()
        n = len(backend.encode(p).ids)
        lat_raw_long.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert len(stub.Encode(pb.EncodeRequest(model=MODEL, text=p)).token_ids) == n
        lat_svc_long.append(time.perf_counter() - t)
    # batched
    t = time.perf_counter()
    batch_tokens = sum(len(e.ids) for e in backend.encode_batch_fast(batch))
    raw_batch_s = time.perf_counter() - t
    req = pb.EncodeBatchRequest(model=MODEL, requests=[pb.EncodeRequest(text=p) for p in batch])
    t = time.perf_counter()
    resp = stub.EncodeBatch(req)
    svc_batch_s = time.perf_counter() - t
    assert sum(len(r.token_ids) for r in resp.results) == batch_tokens
    return {
        "raw_single_p50_ms": pct(lat_raw, 0.5) * 1e3, "raw_single_p99_ms": pct(lat_raw, 0.99) * 1e3,
        "svc_single_p50_ms": pct(lat_svc, 0.5) * 1e3, "svc_single_p99_ms": pct(lat_svc, 0.99) * 1e3,
        "rpc_roundtrip_p50_ms": pct(lat_rpc, 0.5) * 1e3,
        "raw_long_p50_ms": pct(lat_raw_long, 0.5) * 1e3, "svc_long_p50_ms": pct(lat_svc_long, 0.5) * 1e3,
        "raw_single_tok_s": tokens / sum(lat_raw), "svc_single_tok_s": tokens / sum(lat_svc),
        "raw_batch_tok_s": batch_tokens / raw_batch_s, "svc_batch_tok_s": batch_tokens / svc_batch_s,
        "tokens_per_prompt": tokens / len(prompts),
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = summary["median"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["single", "batched"]
    raw = [m["raw_single_tok_s"] / 1e6, m["raw_batch_tok_s"] / 1e6]
    svc = [m["svc_single_tok_s"] / 1e6, m["svc_batch_tok_s"] / 1e6]
    x = range(len(labels))
    a.bar([i - 0.2 for i in x], raw, 0.4, label="raw tokenizers")
    a.bar([i + 0.2 for i in x], svc, 0.4, label="tokenizer service (gRPC)")
    a.set_xticks(list(x), labels)
    a.set_ylabel("M tokens/s")
    a.set_title(f"Throughput, ~1 KB code prompts (batch {summary['batch']})")
    a.legend()
    lat_labels = ["1 KB p50", "1 KB p99", "16 KB p50 / 10"]
    b.bar([-0.2, 0.8, 1.8], [m["raw_single_p50_ms"], m["raw_single_p99_ms"], m["raw_long_p50_ms"] / 10],
          0.4, label="raw tokenizers (one thread)")
    b.bar([0.2, 1.2, 2.2], [m["svc_single_p50_ms"], m["svc_single_p99_ms"], m["svc_long_p50_ms"] / 10],
          0.4, label="service")
    b.axhline(m["rpc_roundtrip_p50_ms"], color="gray", ls="--", label="bare RPC p50")
    b.set_xticks([0, 1, 2], lat_labels)
    b.set_ylabel("ms per prompt")
    b.set_title("Single-prompt latency")
    b.set_ylim(0, 1.4 * max(m["svc_single_p99_ms"], m["raw_single_p99_ms"], m["svc_long_p50_ms"] / 10,
                            m["raw_long_p50_ms"] / 10))
    b.legend(loc="upper left", fontsize=8)
    load = summary["machine"]["load_avg_at_end"][0]
    fig.suptitle(f"SmolLM2 tokenizer, median of {summary['runs']} runs ({summary['started']}, "
                 f"{summary['machine']['cpus']} CPUs, load average {load:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--singles", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--long", type=int, default=20, help="16 KB prompts per run")
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args(argv)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    prompts = code_prompts(a.singles + a.batch)
    singles, batch = prompts[:a.singles], prompts[a.singles:]
    long = code_prompts(a.long, LONG_BYTES)
    backend = load_model_tokenizer(default_model_path()).backend
    port = free_port()
    proc = start_service(port, a.workers)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(ch)
            for p_ in singles[:50]:  # warm both paths
                backend.encode(p_)
                stub.Encode(pb.EncodeRequest(model=MODEL, text=p_))
            runs = [one_run(backend, stub, singles, batch, long) for _ in range(a.runs)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios = {
        "added_latency_p50_ms": median["svc_single_p50_ms"] - median["raw_single_p50_ms"],
        # What the service adds beyond a bare gRPC round trip (GetTokenizerInfo).
        "added_beyond_bare_rpc_p50_ms": (median["svc_single_p50_ms"] - median["raw_single_p50_ms"]
                                         - median["rpc_roundtrip_p50_ms"]),
        "single_throughput_ratio": median["svc_single_tok_s"] / median["raw_single_tok_s"],
        "long_latency_ratio": median["svc_long_p50_ms"] / median["raw_long_p50_ms"],
        "batched_throughput_ratio": median["svc_batch_tok_s"] / median["raw_batch_tok_s"],
    }
    summary = {
        "benchmark": "tokenizer", "started": started, "runs": a.runs, "singles": a.singles,
        "batch": a.batch, "workers": a.workers, "prompt_bytes": 1024, "long_prompts": a.long,
        "long_prompt_bytes": LONG_BYTES,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_end": os.getloadavg()},
        "note": "shared 2-core machine with other engineers' jobs running; compare ratios",
        "median": median, "ratios": ratios, "runs_detail": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tokenizer.json").write_text(json.dumps(summary, indent=2))
    plot(summary, RESULTS / "tokenizer.png")
    print(json.dumps({"median": median, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
