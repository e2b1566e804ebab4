"""Fairness between tenants of one tier: a light tenant's time to first token while another
tenant floods, against the light tenant alone, in the same run.

    python bench/fairness.py [--flood 64] [--seconds 20]

The suite is `tokenserve up`'s default configuration (controlplane.launcher.Suite on free
ports, real SmolLM2). Two tenants on the premium tier (64 concurrent streams allowed):
- alone: the light tenant sends one Chat per second (max_tokens 8) for --seconds;
- flooded: the flooding tenant keeps --flood streams running (max_tokens 64, a new one as
  soon as one ends) and, once they all run, the light tenant sends one per second again.
The engine's fair share admits the tenant with the fewest running sequences first, so the
light tenant's request takes the next free slot; admission caps the flooder at its tier's
concurrency. Reported: the light tenant's TTFT p50/p99 alone and flooded and their ratio
(the issue's bar: p99 within 2x), the flood's tokens/s and its refusals.
Writes bench/results/fairness.json and .png (CPU flags in the JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import json
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
from controlplane.store import ConfigStore  # noqa: E402
from tokenserve.common.v1 import common_pb2  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
QUESTION = "Name one colour of the sky."


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def keys(suite: Suite) -> tuple[str, str]:
    store = ConfigStore([suite.etcd_endpoint])
    try:
        out = []
        for tenant in ("light", "flood"):
            await admin.create_tenant(store, tenant, tenant, "premium", actor="bench")
            out.append((await admin.issue_key(store, tenant, actor="bench"))[0])
        return out[0], out[1]
    finally:
        await store.close()


async def chat(stub, key: str, max_tokens: int) -> tuple[str, float | None, int]:
    """(status, seconds to the first token or None, tokens)."""
    started, first, tokens = time.monotonic(), None, 0
    try:
        async for m in stub.Chat(gateway_pb2.ChatRequest(
                messages=[common_pb2.ChatMessage(role="user", content=QUESTION)],
                max_tokens=max_tokens), metadata=(("authorization", f"Bearer {key}"),),
                timeout=300):
            if m.token_ids and first is None:
                first = time.monotonic() - started
            tokens += len(m.token_ids)
        return "OK", first, tokens
    except grpc.RpcError as e:
        return e.code().name, None, tokens


async def light_series(stub, key: str, seconds: float) -> list[float]:
    tasks = []
    for _ in range(int(seconds)):
        tasks.append(asyncio.create_task(chat(stub, key, 8)))
        await asyncio.sleep(1.0)
    results = await asyncio.gather(*tasks)
    bad = [r[0] for r in results if r[0] != "OK"]
    if bad:
        raise RuntimeError(f"light tenant refused: {bad}")
    return [r[1] for r in results]


async def measure(suite: Suite, args) -> dict:
    light, flood = await keys(suite)
    async with grpc.aio.insecure_channel(suite.address("gateway")) as ch:
        stub = gateway_pb2_grpc.InferenceServiceStub(ch)
        for _ in range(3):  # warm
            await chat(stub, light, 8)
        alone = await light_series(stub, light, args.seconds)

        stop, counts = asyncio.Event(), {"tokens": 0, "OK": 0}
        running = [0]

        async def flooder():
            while not stop.is_set():
                running[0] += 1
                status, _, tokens = await chat(stub, flood, 64)
                running[0] -= 1
                counts[status] = counts.get(status, 0) + 1
                counts["tokens"] += tokens
                if status != "OK":
                    await asyncio.sleep(0.05)

        workers = [asyncio.create_task(flooder()) for _ in range(args.flood)]
        while running[0] < args.flood:
            await asyncio.sleep(0.1)
        await asyncio.sleep(3.0)  # the flood is prefilled and decoding
        t0, tok0 = time.monotonic(), counts["tokens"]
        flooded = await light_series(stub, light, args.seconds)
        flood_tok_s = (counts["tokens"] - tok0) / (time.monotonic() - t0)
        stop.set()
        await asyncio.gather(*workers)
    return {"alone_ttft_s": alone, "flooded_ttft_s": flooded,
            "alone": {"p50": statistics.median(alone), "p99": pct(alone, 99)},
            "flooded": {"p50": statistics.median(flooded), "p99": pct(flooded, 99)},
            "p99_ratio": pct(flooded, 99) / pct(alone, 99),
            "p50_ratio": statistics.median(flooded) / statistics.median(alone),
            "flood": {"streams": args.flood, "tokens_per_s_during_light": flood_tok_s,
                      "outcomes": {k: v for k, v in counts.items() if k != "tokens"}}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result["alone_ttft_s"], "o-", label="light tenant alone")
    ax.plot(result["flooded_ttft_s"], "o-",
            label=f"light tenant, other tenant flooding {result['flood']['streams']} streams")
    ax.set_xlabel("request (one per second)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"fair share by tenant: p99 TTFT ratio {result['p99_ratio']:.2f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "fairness.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ts-fair-") as tmp:
        suite = Suite(Path(tmp) / "suite", SuitePorts.ephemeral(), say=lambda m: None)
        try:
            suite.start()
            result = asyncio.run(measure(suite, args))
        finally:
            suite.stop()
    result.update({"date": datetime.now(timezone.utc).isoformat(), "machine": machine_facts(),
                   "config": {"engine": "tokenserve up defaults", "tier": "premium",
                              "seconds": args.seconds, "flood_streams": args.flood}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"light tenant TTFT alone p50 {result['alone']['p50']:.3f} s p99"
          f" {result['alone']['p99']:.3f} s; flooded p50 {result['flooded']['p50']:.3f} s p99"
          f" {result['flooded']['p99']:.3f} s; p99 ratio {result['p99_ratio']:.2f}x;"
          f" flood {result['flood']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
