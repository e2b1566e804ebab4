"""What the gateway adds over calling the engine directly, with admission off, in memory and
on Redis, in the same run; plus the admission module's decisions per second.

    python bench/gateway_overhead.py [--rounds 30] [--concurrent-rounds 3]

The suite is `tokenserve up`'s default configuration (controlplane.launcher.Suite on free
ports) plus three more gateways on the same etcd, tokenizer, engine and meter: one with
`--quota-store off`, one with `--quota-store redis://...` (a real redis-server) and one with
`--tokenize remote` (prompt ids from the tokenizer service instead of in-process). The
tenant is on the premium tier. Every path gets the same prompt; the direct path sends the
engine the token ids the tokenizer gave for it (the gateway's own tokenizer call is part of
what it adds).

- per request: Generate with max_tokens 1, the paths alternating in a shuffled order each
  round; added = median over rounds of (path latency - direct latency in that round).
- per streamed token: the same with max_tokens 32; (added at 32 - added at 1) / 31.
- 64 concurrent streams: each path in turn runs 64 streams at once (max_tokens 8);
  added = p50/p99 of the path's request latencies minus the direct path's, medians over
  --concurrent-rounds rounds.
Greedy on every path, EOS not ignored: every path generates the same tokens.
- the floor: a bare grpc.aio relay (no protobuf, no logic) in front of a bare echo server,
  against the echo directly, alternating: what any Python gRPC hop adds on this machine.
Writes bench/results/gateway_overhead.json and .png (CPU flags in the JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]

from controlplane import admin
from controlplane.launcher import Suite, SuitePorts
from controlplane.store import ConfigStore
from services.gateway.admission import Limits
from services.gateway.quota_store import MemoryQuotaStore, RedisQuotaStore
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tokenserve.runtime.ports import free_port
from tokenserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

RESULTS = ROOT / "bench" / "results"
PROMPT = "Write one short sentence about the sea and the wind over it."
PATHS = ("direct", "gateway_off", "gateway_memory", "gateway_redis", "gateway_memory_remote_tok")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(line.split(":", 1)[1].split())
    return []


# -- the admission module alone ----------------------------------------------------------
async def admission_rates(redis_url: str, n: int = 20000) -> dict:
    limits = Limits("premium", 1e9, 10**12, 10**12, 10**6)
    mem = MemoryQuotaStore()
    t = time.perf_counter()
    for i in range(n):
        r, _ = mem.admit_now(f"t{i % 100}", limits, f"r{i}", 100, 30)
        mem.settle_now(r, 50)
    memory_per_s = n / (time.perf_counter() - t)
    store = RedisQuotaStore(redis_url)
    m = 2000
    t = time.perf_counter()
    for i in range(m):
        r, _ = await store.admit(f"t{i % 100}", limits, f"r{i}", 100, 30)
        await store.settle(r, 50)
    redis_serial = m / (time.perf_counter() - t)

    async def worker(w):
        for i in range(m // 16):
            r, _ = await store.admit(f"t{w}", limits, f"w{w}-{i}", 100, 30)
            await store.settle(r, 50)
    t = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(16)))
    redis_16 = m / (time.perf_counter() - t)
    await store.close()
    return {"memory_admit_settle_per_s": memory_per_s,
            "redis_admit_settle_per_s_serial": redis_serial,
            "redis_admit_settle_per_s_16_concurrent": redis_16}


# -- the floor: what any Python gRPC hop adds ------------------------------------------------
def _floor_server(port: int, upstream: int | None) -> None:
    """A bare grpc.aio server (no protobuf, no logic): an echo, or with `upstream` a relay
    that streams the upstream echo's answer back, as the gateway streams the engine's."""
    async def serve():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}") if upstream else None
        call = channel.unary_stream("/floor.Floor/Stream") if channel else None

        async def stream(request, context):
            if call is None:
                yield b"x" * 16
                return
            async for message in call(request):
                yield message
        handlers = grpc.method_handlers_generic_handler(
            "floor.Floor", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


async def relay_floor(n: int = 1000) -> dict:
    """Added p50 of a bare Python gRPC relay over calling its upstream directly, alternating
    (the least any Python gRPC front adds on this machine, before any gateway logic)."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    echo_port, relay_port = free_port(), free_port()
    procs = [ctx.Process(target=_floor_server, args=(echo_port, None), daemon=True),
             ctx.Process(target=_floor_server, args=(relay_port, echo_port), daemon=True)]
    for p in procs:
        p.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as direct, \
                grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}") as relay:
            calls = {"direct": direct.unary_stream("/floor.Floor/Stream"),
                     "relay": relay.unary_stream("/floor.Floor/Stream")}
            for call in calls.values():  # wait for both servers, then warm up
                for _ in range(300):
                    try:
                        async for _ in call(b"hi", timeout=5):
                            pass
                        break
                    except grpc.RpcError:
                        await asyncio.sleep(0.1)
                for _ in range(100):
                    async for _ in call(b"hi", timeout=5):
                        pass
            lat = {name: [] for name in calls}
            for _ in range(n):
                for name, call in calls.items():
                    t = time.perf_counter()
                    async for _ in call(b"hi", timeout=5):
                        pass
                    lat[name].append(time.perf_counter() - t)
    finally:
        for p in procs:
            p.kill()
    return {"direct_p50_s": statistics.median(lat["direct"]),
            "relay_p50_s": statistics.median(lat["relay"]),
            "added_p50_s": statistics.median(r - d for r, d in zip(lat["relay"], lat["direct"]))}


# -- the service paths -------------------------------------------------------------------
class Paths:
    def __init__(self, suite: Suite, gateways: dict[str, str], key: str, prompt_ids: list[int]):
        self.key = key
        self.prompt_ids = prompt_ids
        self.channels = {name: grpc.aio.insecure_channel(target)
                         for name, target in {"direct": suite.address("engine"), **gateways}.items()}
        self.engine = engine_pb2_grpc.EngineServiceStub(self.channels["direct"])
        self.gw = {name: gateway_pb2_grpc.InferenceServiceStub(ch)
                   for name, ch in self.channels.items() if name != "direct"}

    async def one(self, path: str, max_tokens: int) -> float:
        t = time.perf_counter()
        if path == "direct":
            call = self.engine.Generate(engine_pb2.GenerateRequest(
                prompt_token_ids=self.prompt_ids, max_tokens=max_tokens),
                timeout=60)
        else:
            call = self.gw[path].Generate(gateway_pb2.GenerateRequest(
                prompt=PROMPT, max_tokens=max_tokens, seed=1, temperature=0.0),
                metadata=(("authorization", f"Bearer {self.key}"),), timeout=60)
        try:
            async for _ in call:
                pass
        except grpc.RpcError as e:
            raise RuntimeError(f"{path}: {e.code().name} {e.details()}") from None
        return time.perf_counter() - t

    async def close(self):
        for ch in self.channels.values():
            await ch.close()


async def serial(paths: Paths, rounds: int, max_tokens: int) -> dict:
    lat = {p: [] for p in PATHS}
    for _ in range(rounds):
        order = list(PATHS)
        random.shuffle(order)
        for p in order:
            lat[p].append(await paths.one(p, max_tokens))
    added = {p: statistics.median(a - d for a, d in zip(lat[p], lat["direct"]))
             for p in PATHS if p != "direct"}
    return {"latency_p50_s": {p: statistics.median(v) for p, v in lat.items()},
            "added_p50_s": added,
            "added_p99_s": {p: pct([a - d for a, d in zip(lat[p], lat["direct"])], 99)
                            for p in PATHS if p != "direct"}}


async def concurrent(paths: Paths, rounds: int, streams: int = 64, max_tokens: int = 8) -> dict:
    p50 = {p: [] for p in PATHS}
    p99 = {p: [] for p in PATHS}
    for _ in range(rounds):
        order = list(PATHS)
        random.shuffle(order)
        for p in order:
            lat = await asyncio.gather(*(paths.one(p, max_tokens) for _ in range(streams)))
            p50[p].append(pct(lat, 50))
            p99[p].append(pct(lat, 99))
    med = lambda d: {p: statistics.median(v) for p, v in d.items()}  # noqa: E731
    m50, m99 = med(p50), med(p99)
    return {"latency_p50_s": m50, "latency_p99_s": m99,
            "added_p50_s": {p: m50[p] - m50["direct"] for p in PATHS if p != "direct"},
            "added_p99_s": {p: m99[p] - m99["direct"] for p in PATHS if p != "direct"}}


def start_gateway(suite: Suite, data: Path, name: str, quota_store: str,
                  *extra: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [sys.executable, "-m", "services.gateway", "--port", str(port), "--metrics-port", "-1", "--http-port", "-1",
           "--etcd-endpoints", suite.etcd_endpoint, "--tokenizer", suite.address("tokenizer"),
           "--meter", suite.address("meter"), "--snapshot", str(data / f"{name}.json"),
           "--spool", str(data / f"{name}.db"), "--quota-store", quota_store,
           "--gateway-id", name, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=(data / f"{name}.log").open("wb"),
                            stderr=subprocess.STDOUT)
    return f"127.0.0.1:{port}", proc


async def wait_ready(target: str, key: str):
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.InferenceServiceStub(ch)
        for _ in range(300):
            try:
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=1),
                                             metadata=(("authorization", f"Bearer {key}"),),
                                             timeout=10):
                    pass
                return
            except grpc.RpcError:
                await asyncio.sleep(0.2)
    raise RuntimeError(f"gateway {target} never answered")


async def premium_key(suite: Suite) -> str:
    store = ConfigStore([suite.etcd_endpoint])
    try:
        await admin.create_tenant(store, "bench", "Benchmark", "premium", actor="bench")
        key, _, _ = await admin.issue_key(store, "bench", actor="bench")
        return key
    finally:
        await store.close()


async def measure(suite: Suite, data: Path, redis_url: str, args) -> dict:
    key = await premium_key(suite)
    gateways, procs = {"gateway_memory": suite.address("gateway")}, []
    for name, store, *extra in (("gateway_off", "off"), ("gateway_redis", redis_url),
                                ("gateway_memory_remote_tok", "memory", "--tokenize", "remote")):
        target, proc = start_gateway(suite, data, name, store, *extra)
        gateways[name] = target
        procs.append(proc)
    try:
        for target in gateways.values():
            await wait_ready(target, key)
        async with grpc.aio.insecure_channel(suite.address("tokenizer")) as ch:
            enc = await tokenizer_pb2_grpc.TokenizerServiceStub(ch).Encode(
                tokenizer_pb2.EncodeRequest(model="smollm2-135m-instruct", text=PROMPT,
                                            add_special_tokens=True), timeout=10)
        paths = Paths(suite, gateways, key, list(enc.token_ids))
        for p in PATHS:  # warm every path
            for _ in range(3):
                await paths.one(p, 1)
        one = await serial(paths, args.rounds, 1)
        many = await serial(paths, args.rounds, 32)
        per_token = {p: (many["added_p50_s"][p] - one["added_p50_s"][p]) / 31
                     for p in one["added_p50_s"]}
        conc = await concurrent(paths, args.concurrent_rounds)
        await paths.close()
        return {"per_request_1_token": one, "per_request_32_tokens": many,
                "added_per_streamed_token_s": per_token, "concurrent_64": conc}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gws = [p for p in PATHS if p != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("added per request, 1 stream (ms)", result["per_request_1_token"]["added_p50_s"]),
              ("added per streamed token (ms)", result["added_per_streamed_token_s"]),
              ("added p50 per request, 64 streams (ms)", result["concurrent_64"]["added_p50_s"])]
    for ax, (title, values) in zip(axes, panels):
        ax.bar([g.replace("gateway_", "") for g in gws], [values[g] * 1000 for g in gws],
               color=["#999", "#4a7", "#47a", "#a74"])
        ax.set_title(title, fontsize=10)
        ax.axhline(0, color="black", linewidth=0.5)
    fig.suptitle("tokenserve gateway overhead over calling the engine directly (admission off /"
                 " memory / Redis / memory with the tokenizer service's round trip)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--concurrent-rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "gateway_overhead.json"))
    args = ap.parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        print("redis-server is needed (apt-get install redis-server)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ts-bench-") as tmp:
        data = Path(tmp)
        redis_port = free_port()
        redis = subprocess.Popen([redis_bin, "--port", str(redis_port), "--save", "",
                                  "--appendonly", "no", "--bind", "127.0.0.1"],
                                 stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        suite = Suite(data / "suite", SuitePorts.ephemeral(), say=lambda m: None)
        try:
            time.sleep(0.3)
            rates = asyncio.run(admission_rates(redis_url))
            floor = asyncio.run(relay_floor())
            suite.start()
            result = asyncio.run(measure(suite, data, redis_url, args))
        finally:
            suite.stop()
            redis.kill()
    result.update({"admission_decisions": rates, "python_grpc_relay_floor": floor,
                   "date": datetime.now(timezone.utc).isoformat(),
                   "machine": {"cpu_flags": cpu_flags(), "cores": __import__("os").cpu_count(),
                               "python": platform.python_version()},
                   "config": {"rounds": args.rounds, "concurrent_rounds": args.concurrent_rounds,
                              "engine": "tokenserve up defaults", "tier": "premium"}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    ms = lambda v: {k: round(x * 1000, 3) for k, x in v.items()}  # noqa: E731
    print("admission decisions/s:", {k: round(v) for k, v in rates.items()})
    print("a bare Python gRPC relay adds, p50 ms:", round(floor["added_p50_s"] * 1000, 3))
    print("added per request, 1 stream, p50 ms:", ms(result["per_request_1_token"]["added_p50_s"]))
    print("added per streamed token ms:", ms(result["added_per_streamed_token_s"]))
    print("added per request, 64 streams, p50 ms:", ms(result["concurrent_64"]["added_p50_s"]))
    print("added per request, 64 streams, p99 ms:", ms(result["concurrent_64"]["added_p99_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
