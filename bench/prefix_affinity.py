"""Prefix affinity against plain least-load routing, on a shared-prefix workload over two real
engine replicas of one version, in the same run.

    python bench/prefix_affinity.py [--quick] [--rounds 4] [--concurrency 4]

The suite is `tokenserve up`'s default configuration (controlplane.launcher.Suite on free
ports, real SmolLM2) with a second engine replica of the same version, both with a small KV
cache (--kv-cache-mb) and one compute thread each, and two more gateways on the same etcd:
`--prefix-affinity` and `--no-prefix-affinity` (both `--quota-store off`). The workload: G
documents, each a prefix of about --prefix-tokens tokens, asked --rounds questions each,
each round asking every document once in a shuffled order (the same for both modes),
--concurrency at a time,
max_tokens 4, greedy. G is chosen from the engines' reported KV blocks so that all the
prefixes together overflow one replica's cache while half of them fit: the case where
the replica a prefix lands on decides whether it is still cached. Each mode gets its own documents
(no mode finds the other's prefixes cached).

Reported per mode: prefix cache hit rate (the engines' cached_tokens / prompt tokens, as the
final usage message reports them), also over the repeated documents only (rounds after the
first, where a hit is possible), and TTFT p50/p99. Writes bench/results/prefix_affinity.json
and .png (CPU flags in the JSON); --quick writes prefix_affinity_quick.* and takes under 3
minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_facts  # noqa: E402
from controlplane import admin  # noqa: E402
from controlplane.launcher import Suite, SuitePorts  # noqa: E402
from controlplane.service_process import ServiceProcess  # noqa: E402
from controlplane.store import ConfigStore  # noqa: E402
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tokenserve.models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, default_model_path  # noqa: E402
from tokenserve.runtime.ports import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODES = ("affinity", "least_load")
WORDS = ("river stone lantern orchard copper meadow harbor violet summit ember cedar falcon"
         " marble thistle glacier saffron pepper willow canyon beacon quartz tundra").split()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def document(mode: str, g: int, words: int) -> str:
    rng = random.Random(f"{mode}-{g}")
    return f"Document {mode} {g}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


async def premium_key(suite: Suite) -> str:
    store = ConfigStore([suite.etcd_endpoint])
    try:
        await admin.create_tenant(store, "bench", "bench", "premium", actor="bench")
        return (await admin.issue_key(store, "bench", actor="bench"))[0]
    finally:
        await store.close()


def start_engine(suite: Suite, data: Path, args) -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.engine", [
        "--port", str(port), "--metrics-port", "-1", "--model-path", str(default_model_path()),
        "--model-name", DEFAULT_MODEL_NAME, "--version", DEFAULT_MODEL_VERSION,
        "--etcd-endpoints", suite.etcd_endpoint, "--meter", suite.address("meter"),
        "--spool", str(data / "engine2-spool.db"), *engine_args(args)],
        port, log_path=data / "logs" / "engine2.log").start(timeout=300)


def engine_args(args) -> tuple[str, ...]:
    return ("--threads", "1", "--kv-cache-mb", str(args.kv_cache_mb), "--no-speculation")


def start_gateway(suite: Suite, data: Path, name: str, affinity: bool) -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.gateway", [
        "--port", str(port), "--metrics-port", "-1", "--http-port", "-1",
        "--etcd-endpoints", suite.etcd_endpoint, "--tokenizer", suite.address("tokenizer"),
        "--meter", suite.address("meter"), "--snapshot", str(data / f"{name}.json"),
        "--spool", str(data / f"{name}.db"), "--quota-store", "off", "--gateway-id", name,
        "--prefix-affinity" if affinity else "--no-prefix-affinity"],
        port, log_path=data / "logs" / f"{name}.log").start(timeout=60)


async def engines_info(targets: list[str]) -> list[engine_pb2.GetInfoResponse]:
    out = []
    for t in targets:
        async with grpc.aio.insecure_channel(t) as ch:
            out.append(await engine_pb2_grpc.EngineServiceStub(ch).GetInfo(
                engine_pb2.GetInfoRequest(), timeout=10))
    return out


async def both_registered(suite: Suite, timeout: float = 30.0) -> None:
    """Until etcd lists both engine replicas; the gateways' watchers apply a change within a
    second, so one more second after that."""
    store = ConfigStore([suite.etcd_endpoint])
    try:
        deadline = time.monotonic() + timeout
        while len(await store.list("engines")) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the second engine replica never registered")
            await asyncio.sleep(0.2)
    finally:
        await store.close()
    await asyncio.sleep(1.0)


async def one(stub, key: str, prompt: str) -> dict:
    started, first = time.monotonic(), None
    async for m in stub.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, max_tokens=4, temperature=0.0),
            metadata=(("authorization", f"Bearer {key}"),), timeout=300):
        if m.token_ids and first is None:
            first = time.monotonic() - started
        if m.HasField("usage"):
            usage = m.usage
    return {"ttft_s": first, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens}


async def run_mode(stub, key: str, mode: str, groups: int, rounds: int, words: int,
                   concurrency: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    rng = random.Random(7)  # the same order of documents for both modes
    for r in range(rounds):
        for g in rng.sample(range(groups), groups):
            queue.put_nowait((r, document(mode, g, words) + f"Question {r}: what is word {r + 1}?"))
    results: list[dict] = []

    async def worker():
        while not queue.empty():
            r, prompt = queue.get_nowait()
            results.append({"round": r, **await one(stub, key, prompt)})

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.monotonic() - t0
    ttfts = [r["ttft_s"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    repeats = [r for r in results if r["round"] > 0]  # the document was asked before
    return {"requests": len(results), "seconds": seconds, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt,
            "repeat_hit_rate": sum(r["cached_tokens"] for r in repeats)
            / max(1, sum(r["prompt_tokens"] for r in repeats)),
            "repeat_ttft_p50_s": statistics.median([r["ttft_s"] for r in repeats] or [0.0]),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": pct(ttfts, 99),
            "ttft_s": ttfts}


async def measure(suite: Suite, gateways: dict[str, str], engine_targets: list[str],
                  args) -> dict:
    key = await premium_key(suite)
    infos = await engines_info(engine_targets)
    blocks = min(i.kv_blocks_total for i in infos)
    block = infos[0].kv_block_size
    stubs, channels = {}, []
    for mode, target in gateways.items():
        ch = grpc.aio.insecure_channel(target)
        channels.append(ch)
        stubs[mode] = gateway_pb2_grpc.InferenceServiceStub(ch)
    try:
        count = await stubs["affinity"].CountTokens(
            gateway_pb2.CountTokensRequest(model=DEFAULT_MODEL_NAME,
                                           prompt=document("affinity", 0, args.words)),
            metadata=(("authorization", f"Bearer {key}"),), timeout=30)
        prefix_blocks = count.count // block
        # All prefixes overflow one replica's cache by half again; half of them fit in one,
        # next to the blocks of the requests running.
        groups = max(4, math.ceil(1.5 * blocks / max(1, prefix_blocks)))
        await both_registered(suite)
        for mode in MODES:  # warm
            await one(stubs[mode], key, "Hello.")
        out = {"prefix_tokens": count.count, "prefix_blocks": prefix_blocks,
               "kv_blocks_per_replica": blocks, "kv_block_size": block, "documents": groups}
        order = list(MODES) if not args.least_load_first else list(reversed(MODES))
        for mode in order:
            out[mode] = await run_mode(stubs[mode], key, mode, groups, args.rounds, args.words,
                                       args.concurrency)
        return out
    finally:
        for ch in channels:
            await ch.close()


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.8))
    x = range(len(MODES))
    a.bar([i - 0.2 for i in x], [result[m]["hit_rate"] * 100 for m in MODES], 0.4,
          label="all requests", color="tab:gray")
    a.bar([i + 0.2 for i in x], [result[m]["repeat_hit_rate"] * 100 for m in MODES], 0.4,
          label="repeated documents", color="tab:green")
    a.set_xticks(list(x), MODES)
    a.legend(fontsize=8)
    a.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    a.set_title(f"{result['documents']} documents x {result['prefix_tokens']} tokens")
    for m, style in zip(MODES, ("o-", "s-")):
        b.plot(result[m]["ttft_s"], style, markersize=3, label=f"{m} (p50"
               f" {result[m]['ttft_p50_s']:.2f} s)")
    b.set_xlabel("request (in completion order)")
    b.set_ylabel("time to first token (s)")
    b.legend(fontsize=8)
    fig.suptitle("prefix affinity vs least-load, two engine replicas", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a small run (under 3 minutes): shorter prefixes, 2 rounds, 2 at a time")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--words", type=int, default=120, help="words per document prefix")
    ap.add_argument("--kv-cache-mb", type=int, default=48, help="per engine replica")
    ap.add_argument("--least-load-first", action="store_true", help="run the plain mode first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.concurrency, args.words, args.kv_cache_mb = 2, 2, 60, 16
    out = Path(args.out or RESULTS / f"prefix_affinity{'_quick' if args.quick else ''}.json")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ts-affinity-") as tmp:
        data = Path(tmp) / "suite"
        suite = Suite(data, SuitePorts.ephemeral(), say=lambda m: None,
                      engine_args=engine_args(args))
        procs: list[ServiceProcess] = []
        try:
            suite.start()
            procs.append(start_engine(suite, data, args))
            gateways = {}
            for mode in MODES:
                procs.append(start_gateway(suite, data, f"gw-{mode}", mode == "affinity"))
                gateways[mode] = procs[-1].target
            result = asyncio.run(measure(suite, gateways, [suite.address("engine"),
                                                           procs[0].target], args))
        finally:
            for p in reversed(procs):
                p.stop()
            suite.stop()
    result.update({"date": datetime.now(timezone.utc).isoformat(), "machine": machine_facts(),
                   "wall_seconds": round(time.monotonic() - started, 1),
                   "config": {"replicas": 2, "engine": " ".join(engine_args(args)),
                              "rounds": args.rounds, "concurrency": args.concurrency,
                              "words": args.words, "max_tokens": 4, "quick": args.quick}})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    for m in MODES:
        r = result[m]
        print(f"{m:>10}: hit rate {r['hit_rate']:.1%} (repeated documents"
              f" {r['repeat_hit_rate']:.1%}), TTFT p50 {r['ttft_p50_s']:.3f} s"
              f" p99 {r['ttft_p99_s']:.3f} s (repeated p50 {r['repeat_ttft_p50_s']:.3f} s),"
              f" {r['requests']} requests in {r['seconds']:.1f} s")
    print(f"{result['documents']} documents of {result['prefix_tokens']} tokens,"
          f" {result['kv_blocks_per_replica']} KV blocks per replica;"
          f" {result['wall_seconds']} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
