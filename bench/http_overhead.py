"""What the gateway adds: the same streaming chat through the HTTP front, through gRPC, and
straight to the engine, at 1 and 64 concurrent streams, in the same run.

    python bench/http_overhead.py [--runs 3] [--tokens 64] [--requests 64]

The engine is a stand-in process that streams `--tokens` tokens as fast as it can (real
engine RPCs, no model), so that what is measured is the path, not the model: etcd, the real
tokenizer and meter services, and the real gateway (`python -m services.gateway`) with the
stand-in as its engine. Clients run in this process on asyncio: grpc.aio for the engine and
the gateway's gRPC API, a keep-alive HTTP/1.1 client reading the SSE stream for the HTTP front.
Per request: time to first token (TTFT); per streamed token: (last token - first token) /
(tokens - 1). Added = path - engine direct (gateway gRPC, HTTP) and HTTP - gateway gRPC, for
p50 and p99; medians over `--runs`. Writes bench/results/http_overhead.json (with the
machine's facts, the goals, whether each was met, and the LiteLLM anchor) and
bench/results/http_overhead.png.

Goal: the HTTP front adds < 2 ms p50 per request and < 0.2 ms p50 per streamed token over
gRPC. Anchor: LiteLLM reports 3.25 ms added per request (median 12 ms at ~1,000 RPS on 2
instances).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from controlplane.etcd_local import EtcdProcess  # noqa: E402
from controlplane.schema import (ModelSpec, ModelVersion, Route, Tenant, Tier,  # noqa: E402
                                 generate_api_key)
from controlplane.store import ConfigStore  # noqa: E402
from tokenserve.common.v1 import common_pb2  # noqa: E402
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402
from tokenserve.runtime.ports import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PATHS = ("engine", "grpc", "http")
# What the HTTP front may add over the gateway's gRPC API (p50, at every concurrency level).
GOALS = {"http_over_grpc_request_p50_ms": 2.0, "http_over_grpc_token_p50_ms": 0.2}
ANCHOR = {"name": "LiteLLM", "added_per_request_ms": 3.25,
          "reported": "3.25 ms added per request, median 12 ms at ~1,000 RPS on 2 instances"}
GOALS_LINE = (f"goal: HTTP adds < {GOALS['http_over_grpc_request_p50_ms']:g} ms p50 per request"
              f" and < {GOALS['http_over_grpc_token_p50_ms']:g} ms p50 per streamed token over"
              f" gRPC; anchor: {ANCHOR['name']} adds {ANCHOR['added_per_request_ms']:g} ms per"
              " request")


# -- the stand-in engine (run as `--serve-engine PORT`) ------------------------------------

class StandInEngine(engine_pb2_grpc.EngineServiceServicer):
    async def Generate(self, request, context):
        n = request.max_tokens
        for i in range(n):
            resp = engine_pb2.GenerateResponse(token_ids=[1000 + i], text=" tok")
            if i == n - 1:
                resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
                resp.usage.CopyFrom(common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids), completion_tokens=n))
            yield resp

    async def GetInfo(self, request, context):
        return engine_pb2.GetInfoResponse(model=DEFAULT_MODEL_NAME, version="v1",
                                          max_context=4096)


async def serve_engine(port: int) -> None:
    from grpc_health.v1 import health
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(StandInEngine(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


# -- the suite -------------------------------------------------------------------------------

class Stack:
    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []
        self.ports = {n: free_port() for n in ("etcd", "peer", "meter", "tokenizer", "engine",
                                               "gateway", "http")}
        self.etcd = EtcdProcess(tmp / "etcd", self.ports["etcd"], self.ports["peer"],
                                log_path=tmp / "etcd.log", unsafe_no_fsync=True)
        self.key = ""

    def _spawn(self, args: list[str], port: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        with open(self.tmp / f"{port}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"{args} exited: {(self.tmp / f'{port}.log').read_text()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{args} not serving")

    async def _seed(self) -> None:
        key, record = generate_api_key("bench")
        async with ConfigStore([self.etcd.endpoint]) as store:
            for doc in (Tier("bench", 100_000, 1_000_000_000, 10_000_000_000, 1024, 1, 4096),
                        Tenant("bench", "Bench", "bench"),
                        # the artifact `tokenserve up` seeds: the gateway tokenizes in-process
                        ModelSpec(DEFAULT_MODEL_NAME,
                                  {"v1": ModelVersion(f"builtin:{DEFAULT_MODEL_NAME}", 4096)},
                                  "v1"),
                        Route(DEFAULT_MODEL_NAME, {"v1": 1}), record):
                await store.put(doc, actor="bench")
        self.key = key

    def start(self) -> None:
        p, model = self.ports, str(default_model_path())
        self.etcd.start()
        asyncio.run(self._seed())
        self._spawn(["-m", "services.meter", "--port", str(p["meter"]), "--metrics-port", "-1",
                     "--db", str(self.tmp / "meter.db")], p["meter"])
        self._spawn(["-m", "services.tokenizer", "--port", str(p["tokenizer"]),
                     "--metrics-port", "-1", "--model", f"{DEFAULT_MODEL_NAME}={model}"],
                    p["tokenizer"])
        self._spawn([__file__, "--serve-engine", str(p["engine"])], p["engine"])
        self._spawn(["-m", "services.gateway", "--port", str(p["gateway"]),
                     "--http-port", str(p["http"]), "--metrics-port", "-1",
                     "--etcd-endpoints", self.etcd.endpoint,
                     "--tokenizer", f"127.0.0.1:{p['tokenizer']}",
                     "--meter", f"127.0.0.1:{p['meter']}",
                     "--engine", f"{DEFAULT_MODEL_NAME}=v1=127.0.0.1:{p['engine']}",
                     "--snapshot", str(self.tmp / "gw.json"),
                     "--spool", str(self.tmp / "spool.db")], p["gateway"])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.etcd.stop()


# -- clients: each returns (TTFT, per-token seconds) of one streamed request ----------------

class EngineClient:
    def __init__(self, stack: Stack, tokens: int):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['engine']}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.req = engine_pb2.GenerateRequest(prompt_token_ids=list(range(40)),
                                              max_tokens=tokens)

    async def one(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async for _ in self.stub.Generate(self.req, timeout=60):
            last = time.perf_counter()
            first = first or last
            n += 1
        return first - t0, (last - first) / max(1, n - 1)

    async def close(self):
        await self.channel.close()


class GrpcClient(EngineClient):
    def __init__(self, stack: Stack, tokens: int):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['gateway']}")
        self.stub = gateway_pb2_grpc.InferenceServiceStub(self.channel)
        self.md = (("authorization", f"Bearer {stack.key}"),)
        self.req = gateway_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(**m) for m in MESSAGES], max_tokens=tokens)

    async def one(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async for _ in self.stub.Chat(self.req, metadata=self.md, timeout=60):
            last = time.perf_counter()
            first = first or last
            n += 1
        return first - t0, (last - first) / max(1, n - 1)


class HttpClient:
    """One keep-alive HTTP/1.1 connection per concurrent stream; reads chunked SSE."""

    def __init__(self, stack: Stack, tokens: int):
        self.port, self.key = stack.ports["http"], stack.key
        body = json.dumps({"model": "", "messages": MESSAGES, "max_tokens": tokens,
                           "stream": True}).encode()
        self.request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                        f"authorization: Bearer {self.key}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\n\r\n").encode() + body
        self.pool: list = []

    async def _conn(self):
        if self.pool:
            return self.pool.pop()
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def one(self) -> tuple[float, float]:
        pooled = bool(self.pool)
        reader, writer = await self._conn()
        t0 = time.perf_counter()
        writer.write(self.request)
        status = await reader.readline()
        if not status and pooled:
            # the server closed an idle keep-alive connection (uvicorn: after 5 s), as it
            # may: a client opens a new one, and so does this one, off the clock
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            t0 = time.perf_counter()
            writer.write(self.request)
            status = await reader.readline()
        assert b" 200 " in status, status
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers; uvicorn streams with chunked transfer encoding
        first = last = None
        n, buf = 0, b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            buf += data[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event != b"data: [DONE]":
                    last = time.perf_counter()
                    first = first or last
                    n += 1
        self.pool.append((reader, writer))
        return first - t0, (last - first) / max(1, n - 1)

    async def close(self):
        for _, writer in self.pool:
            writer.close()


async def measure(client, concurrency: int, requests: int) -> dict[str, float]:
    results: list[tuple[float, float]] = []

    async def worker(n: int):
        for _ in range(n):
            results.append(await client.one())

    per = max(1, requests // concurrency)
    await asyncio.gather(*(worker(2) for _ in range(concurrency)))  # warm up connections
    results.clear()
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    ttft = sorted(r[0] for r in results)
    itl = sorted(r[1] for r in results)

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    return {"ttft_p50_ms": q(ttft, 0.5), "ttft_p99_ms": q(ttft, 0.99),
            "token_p50_ms": q(itl, 0.5), "token_p99_ms": q(itl, 0.99), "requests": len(results)}


async def one_run(stack: Stack, tokens: int, requests: int) -> dict:
    out: dict = {}
    clients = {"engine": EngineClient(stack, tokens), "grpc": GrpcClient(stack, tokens),
               "http": HttpClient(stack, tokens)}
    try:
        for c in (1, 64):
            print(f"{time.strftime('%X')} {c} stream(s)", file=sys.stderr, flush=True)
            # paths alternate within a concurrency level, so drift hits all three alike
            out[str(c)] = {name: await measure(cl, c, requests * (1 if c == 1 else 4))
                           for name, cl in clients.items()}
    finally:
        for cl in clients.values():
            await cl.close()
    return out


def summarize(runs: list[dict]) -> dict:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "token_p50_ms", "token_p99_ms")
    med = {c: {p: {k: statistics.median(r[c][p][k] for r in runs) for k in keys}
               for p in PATHS} for c in runs[0]}
    added = {}
    for c, paths in med.items():
        added[c] = {}
        for name, base, over in (("grpc_over_engine", "engine", "grpc"),
                                 ("http_over_engine", "engine", "http"),
                                 ("http_over_grpc", "grpc", "http")):
            added[c][name] = {
                "request_p50_ms": paths[over]["ttft_p50_ms"] - paths[base]["ttft_p50_ms"],
                "request_p99_ms": paths[over]["ttft_p99_ms"] - paths[base]["ttft_p99_ms"],
                "token_p50_ms": paths[over]["token_p50_ms"] - paths[base]["token_p50_ms"],
                "token_p99_ms": paths[over]["token_p99_ms"] - paths[base]["token_p99_ms"]}
    met = {c: {"request": a["http_over_grpc"]["request_p50_ms"]
                          < GOALS["http_over_grpc_request_p50_ms"],
               "token": a["http_over_grpc"]["token_p50_ms"]
                        < GOALS["http_over_grpc_token_p50_ms"]}
           for c, a in added.items()}
    return {"median": med, "added": added, "goals_met": met}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    levels = list(result["median"])
    width = 0.25
    for ax, metric, title in ((axes[0], "ttft", "time to first token (ms)"),
                              (axes[1], "token", "per streamed token (ms)")):
        for i, p in enumerate(PATHS):
            xs = [j + (i - 1) * width for j in range(len(levels))]
            p50 = [result["median"][c][p][f"{metric}_p50_ms"] for c in levels]
            p99 = [result["median"][c][p][f"{metric}_p99_ms"] for c in levels]
            ax.bar(xs, p50, width, label=f"{p} p50")
            ax.scatter(xs, p99, marker="_", s=200, color="black",
                       label="p99" if i == 0 else None)
        ax.set_xticks(range(len(levels)), [f"{c} stream(s)" for c in levels])
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("Streaming chat: engine direct vs gateway gRPC vs gateway HTTP (SSE)\n"
                 + GOALS_LINE, fontsize=10)
    measured = "; ".join(
        f"{c} stream(s): HTTP over gRPC {a['http_over_grpc']['request_p50_ms']:+.2f} ms per"
        f" request, {a['http_over_grpc']['token_p50_ms']:+.3f} ms per token (p50)"
        for c, a in result["added"].items())
    fig.text(0.5, 0.01, measured, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=64,
                    help="streams per path at 1 stream; 4x this at 64")
    ap.add_argument("--serve-engine", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_engine:
        asyncio.run(serve_engine(a.serve_engine))
        return
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(Path(d))
        try:
            print(f"{time.strftime('%X')} starting the stack", file=sys.stderr, flush=True)
            stack.start()
            runs = [asyncio.run(one_run(stack, a.tokens, a.requests)) for _ in range(a.runs)]
        finally:
            stack.stop()
    from bench.machine import machine_facts  # imports torch: only once the runs are done
    result = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.machine(),
              "load_avg_1m": os.getloadavg()[0], **machine_facts(),
              "runs": a.runs, "tokens": a.tokens, "requests": a.requests,
              "goals": GOALS, "anchor": ANCHOR, **summarize(runs), "all_runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "http_overhead.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "http_overhead.png")
    for c, paths in result["median"].items():
        for p, m in paths.items():
            print(f"{c:>3} stream(s) {p:7s} TTFT p50 {m['ttft_p50_ms']:7.2f} p99 "
                  f"{m['ttft_p99_ms']:7.2f} ms | per token p50 {m['token_p50_ms']:.3f} p99 "
                  f"{m['token_p99_ms']:.3f} ms")
        for name, v in result["added"][c].items():
            print(f"    added {name:17s} request p50 {v['request_p50_ms']:+.2f} ms p99 "
                  f"{v['request_p99_ms']:+.2f} ms | token p50 {v['token_p50_ms']:+.3f} ms"
                  f" p99 {v['token_p99_ms']:+.3f} ms")
        print(f"    goals met: {result['goals_met'][c]}")
    print(GOALS_LINE)


if __name__ == "__main__":
    main()
