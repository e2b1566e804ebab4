"""A 10x-capacity burst mixed across tiers, with the degradation ladder on and then off, in
one run: does premium keep its time to first token, and what breaks without the ladder?

    python bench/overload.py [--capacity 8] [--seconds 45] [--quick]

The suite is `tokenserve up`'s (controlplane.launcher.Suite on free ports, real SmolLM2),
its engine started with --max-concurrency CAPACITY. Tier limits are raised for the run so
only the ladder (never a tier's rate or concurrency cap) refuses. The ladder is the seeded
one (level 1 caps free max_tokens, 2 sheds free, 3 sheds standard) with queue_depth =
CAPACITY waiting requests, TTFT p99 2 s (the design default), cap_max_tokens 8 and a short
hold. Phases, each --seconds long:

- capacity: CAPACITY closed-loop premium clients (a new Chat as soon as one ends): the
  completions per second R the engine sustains at full batch;
- unloaded: premium requests alone, arriving at 0.25 R (Poisson, seeded);
- ladder on: requests arriving at 10 R: premium as before, standard 3 R, free 6.75 R;
- ladder off (`tsctl degrade set --disable`): the same arrivals.

Reported per phase and tier: requests OK, shed (RESOURCE_EXHAUSTED, limit `degraded`), every
other code seen (INTERNAL must never appear; FINISH_CANCELLED: the stream ended with finish
reason cancelled, the engine's deadline having passed first), requests still running when
the phase ended, TTFT p50/p99 of the OK ones, tokens/s; premium p99 TTFT over its unloaded
value (the goal: within 2x with the ladder on); the gateway's peak RSS. The timeline (level,
engine queue from its WatchLoad stream, per-tier completions/s) is sampled every 0.5 s.
Writes bench/results/overload.json and .png (machine facts, CPU flags included). --quick
(capacity 4, 15 s phases, max_tokens 16) finishes in under 3 minutes: a check that the bench
works, not a result.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_facts  # noqa: E402
from controlplane import admin  # noqa: E402
from controlplane.launcher import Suite, SuitePorts  # noqa: E402
from controlplane.store import ConfigStore  # noqa: E402
from controlplane.top import parse_samples  # noqa: E402
from tokenserve.common.v1 import common_pb2  # noqa: E402
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TIERS = ("free", "standard", "premium")
# The burst's arrivals per second, in units of the capacity R: premium keeps the light load it
# has alone (a quarter of R); free and standard bring the total to 10 R.
BURST = {"free": 6.75, "standard": 3.0, "premium": 0.25}
QUESTION = "Tell me a short story about a lighthouse keeper."


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Recorder:
    """Every request's outcome, and the timeline samples, stamped from the phase start."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.requests: list[dict] = []
        self.timeline: list[dict] = []
        self.rss_kb = 0

    def now(self) -> float:
        return time.monotonic() - self.t0


async def chat(stub, key: str, max_tokens: int, timeout: float) -> tuple[str, float | None, int, str]:
    """(code, seconds to the first token or None, tokens, refusal limit). A stream that ends
    with finish_reason cancelled (the engine's deadline passed first) is FINISH_CANCELLED."""
    started, first, tokens, finish = time.monotonic(), None, 0, 0
    call = stub.Chat(gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=QUESTION)], max_tokens=max_tokens),
        metadata=(("authorization", f"Bearer {key}"),), timeout=timeout)
    try:
        async for m in call:
            if m.token_ids and first is None:
                first = time.monotonic() - started
            tokens += len(m.token_ids)
            finish = m.finish_reason or finish
    except grpc.RpcError as e:
        limit = dict(await call.trailing_metadata() or ()).get("limit", "")
        return e.code().name, first, tokens, limit
    if finish == common_pb2.FINISH_REASON_CANCELLED:
        return "FINISH_CANCELLED", first, tokens, ""
    return ("OK" if finish else "NO_FINISH"), first, tokens, ""


async def client(stub, tier: str, key: str, rec: Recorder, stop: asyncio.Event, args) -> None:
    """Closed loop: a new Chat as soon as one ends."""
    while not stop.is_set():
        await one(stub, tier, key, rec, stop, args)


async def one(stub, tier: str, key: str, rec: Recorder, stop: asyncio.Event, args) -> None:
    at = rec.now()
    code, ttft, tokens, limit = await chat(stub, key, args.max_tokens, args.deadline)
    if stop.is_set():  # cut off by the end of the phase: not an outcome
        return
    rec.requests.append({"tier": tier, "at": at, "done": rec.now(), "code": code,
                         "ttft": ttft, "tokens": tokens, "shed": limit == "degraded"})


async def arrivals(stub, keys: dict, rates: dict[str, float], rec: Recorder,
                   stop: asyncio.Event, args, tasks: list) -> None:
    """Open loop: Poisson arrivals at sum(rates) per second, each tier by its share."""
    rng = random.Random(13)
    total, tiers = sum(rates.values()), list(rates)
    while not stop.is_set():
        await asyncio.sleep(rng.expovariate(total))
        tier = rng.choices(tiers, weights=[rates[t] for t in tiers])[0]
        tasks.append(asyncio.create_task(one(stub, tier, keys[tier], rec, stop, args)))


def gateway_level(metrics: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=2) as r:
            return parse_samples(r.read().decode()).get(("tokenserve_gateway_degradation_level", ()))
    except OSError:
        return None


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def sample(suite: Suite, rec: Recorder, stop: asyncio.Event) -> None:
    """Level (gateway /metrics), queue depth (the engine's WatchLoad stream), gateway RSS."""
    latest: dict = {}

    async def follow():
        async with grpc.aio.insecure_channel(suite.address("engine")) as ch:
            async for r in engine_pb2_grpc.EngineServiceStub(ch).WatchLoad(engine_pb2.WatchLoadRequest()):
                latest.update(waiting=r.waiting, running=r.running, ttft_p99_s=r.ttft_p99_seconds,
                              watts=r.watts)

    watcher = asyncio.create_task(follow())
    pid = suite.procs["gateway"].proc.pid
    try:
        while not stop.is_set():
            level = await asyncio.to_thread(gateway_level, suite.address("gateway_metrics"))
            rss = rss_kb(pid)
            rec.rss_kb = max(rec.rss_kb, rss)
            rec.timeline.append({"t": round(rec.now(), 2), "level": level, "rss_kb": rss, **latest})
            await asyncio.sleep(0.5)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def phase(suite: Suite, keys: dict, args, *, clients: dict[str, int] | None = None,
                rates: dict[str, float] | None = None) -> dict:
    """Closed-loop `clients` per tier, or open-loop arrivals at `rates` per tier per second."""
    rec, stop, tasks = Recorder(), asyncio.Event(), []
    async with grpc.aio.insecure_channel(suite.address("gateway")) as ch:
        stub = gateway_pb2_grpc.InferenceServiceStub(ch)
        sampler = asyncio.create_task(sample(suite, rec, stop))
        if clients:
            tasks += [asyncio.create_task(client(stub, tier, keys[tier], rec, stop, args))
                      for tier, n in clients.items() for _ in range(n)]
        else:
            tasks.append(asyncio.create_task(arrivals(stub, keys, rates, rec, stop, args, tasks)))
        await asyncio.sleep(args.seconds)
        stop.set()
        running = sum(not t.done() for t in tasks) - (0 if clients else 1)
        for t in list(tasks):  # leaving a call cancels it: the engine frees its work at once
            t.cancel()
        await asyncio.gather(*tasks, sampler, return_exceptions=True)
    out = summarize(rec, list(clients or rates), args.seconds)
    out["running_at_end"] = running
    out["load"] = {"clients": clients} if clients else {"arrivals_per_s": rates}
    return out


def summarize(rec: Recorder, names: list[str], seconds: float) -> dict:
    tiers = {}
    for tier in names:
        rs = [r for r in rec.requests if r["tier"] == tier]
        ok = [r for r in rs if r["code"] == "OK"]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        tiers[tier] = {"requests": len(rs), "ok": len(ok),
                       "shed": sum(r["shed"] for r in rs),
                       "codes": dict(Counter(r["code"] for r in rs)),
                       "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                       "tokens_per_s": round(sum(r["tokens"] for r in ok) / seconds, 2)}
    buckets = int(seconds) + 1
    throughput = {t: [0] * buckets for t in names}  # OK completions per second
    for r in rec.requests:
        if r["code"] == "OK" and int(r["done"]) < buckets:
            throughput[r["tier"]][int(r["done"])] += 1
    codes = sorted({c for t in tiers.values() for c in t["codes"]})
    return {"tiers": tiers, "codes_seen": codes, "internal": sum(
        t["codes"].get("INTERNAL", 0) for t in tiers.values()), "gateway_peak_rss_mb":
            round(rec.rss_kb / 1024, 1), "max_level": max(
            (s["level"] or 0 for s in rec.timeline), default=0),
            "timeline": rec.timeline, "throughput_per_s": throughput}


async def prepare(suite: Suite, args) -> dict[str, str]:
    """Bench tenants (one per tier), tier limits out of the way, the ladder for this machine."""
    async with ConfigStore([suite.etcd_endpoint]) as store:
        keys = {}
        for tier in TIERS:
            await admin.set_tier(store, tier, {"requests_per_second": 10_000,
                                               "tokens_per_minute": 100_000_000,
                                               "daily_tokens": 1_000_000_000,
                                               "max_concurrency": 10_000}, actor="bench")
            await admin.create_tenant(store, f"bench-{tier}", f"bench {tier}", tier, actor="bench")
            keys[tier] = (await admin.issue_key(store, f"bench-{tier}", actor="bench"))[0]
        await admin.set_degradation(store, thresholds={"queue_depth": args.capacity,
                                                       "ttft_p99_seconds": 2.0},
                                    cap_max_tokens=args.cap_max_tokens,
                                    settings={"hold_seconds": args.hold, "enabled": True},
                                    actor="bench")
    async with grpc.aio.insecure_channel(suite.address("gateway")) as ch:
        stub = gateway_pb2_grpc.InferenceServiceStub(ch)
        for key in keys.values():  # until the gateway's watch has the new keys
            for _ in range(100):
                try:
                    await stub.CountTokens(gateway_pb2.CountTokensRequest(prompt="x"), timeout=5,
                                           metadata=(("authorization", f"Bearer {key}"),))
                    break
                except grpc.RpcError:
                    await asyncio.sleep(0.1)
    return keys


async def set_ladder(suite: Suite, enabled: bool) -> None:
    async with ConfigStore([suite.etcd_endpoint]) as store:
        await admin.set_degradation(store, settings={"enabled": enabled}, actor="bench")


async def settle(suite: Suite, timeout: float, *, idle: bool = True) -> bool:
    """Until the engine is idle (when `idle`) and the gateway at level 0; False when it timed
    out."""
    end = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(suite.address("engine")) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        while time.monotonic() < end:
            info = await stub.GetInfo(engine_pb2.GetInfoRequest())
            level = await asyncio.to_thread(gateway_level, suite.address("gateway_metrics"))
            if (not idle or info.running == 0 and info.waiting == 0) and not level:
                return True
            await asyncio.sleep(0.5)
    return False


async def measure(suite: Suite, args) -> dict:
    keys = await prepare(suite, args)
    async with grpc.aio.insecure_channel(suite.address("gateway")) as ch:  # warm
        await chat(gateway_pb2_grpc.InferenceServiceStub(ch), keys["premium"], 4, 120)
    out = {"capacity": await phase(suite, keys, args, clients={"premium": args.capacity})}
    r = out["capacity"]["tiers"]["premium"]["ok"] / args.seconds
    if r <= 0:
        raise RuntimeError("no request finished at capacity; a longer --seconds is needed")
    burst = {t: r * BURST[t] for t in TIERS}
    out["capacity_requests_per_s"] = round(r, 3)
    settled = {"unloaded": await settle(suite, args.settle)}
    out["unloaded"] = await phase(suite, keys, args, rates={"premium": burst["premium"]})
    settled["ladder_on"] = await settle(suite, args.settle)
    out["ladder_on"] = await phase(suite, keys, args, rates=burst)
    settled["ladder_off"] = await settle(suite, args.settle)
    await set_ladder(suite, False)
    await settle(suite, 5, idle=False)  # the gateway drops to level 0 at once
    out["ladder_off"] = await phase(suite, keys, args, rates=burst)
    out["settled_before"] = settled  # False: the previous phase's work was still running
    await set_ladder(suite, True)
    base = out["unloaded"]["tiers"]["premium"]["ttft_p99_s"]
    out["premium_p99_ttft_vs_unloaded"] = {
        k: (round(p / base, 2) if base and (p := out[k]["tiers"]["premium"]["ttft_p99_s"]) else None)
        for k in ("ladder_on", "ladder_off")}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("ladder_on", "ladder_off")
    fig, axes = plt.subplots(3, 2, figsize=(11, 7), sharex="col", sharey="row")
    for col, name in enumerate(names):
        ph = result[name]
        tl = ph["timeline"]
        t = [s["t"] for s in tl]
        axes[0][col].step(t, [s["level"] or 0 for s in tl], where="post", color="crimson")
        axes[1][col].plot(t, [s.get("waiting", 0) for s in tl], label="waiting")
        axes[1][col].plot(t, [s.get("running", 0) for s in tl], label="running")
        for tier, per_s in ph["throughput_per_s"].items():
            axes[2][col].plot(range(len(per_s)), per_s, label=tier)
        ratio = result["premium_p99_ttft_vs_unloaded"][name]
        axes[0][col].set_title(f"{name.replace('_', ' ')}: premium p99 TTFT "
                               f"{'-' if ratio is None else f'{ratio}x'} unloaded", fontsize=9)
        axes[2][col].set_xlabel("seconds into the burst")
    axes[0][0].set_ylabel("degradation level")
    axes[1][0].set_ylabel("engine requests")
    axes[2][0].set_ylabel("completed / s")
    axes[1][0].legend(fontsize=7)
    axes[2][0].legend(fontsize=7)
    fig.suptitle(f"arrivals at 10x capacity ({10 * result['capacity_requests_per_s']:.2f}/s; "
                 f"--max-concurrency {result['config']['capacity']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=8, help="engine --max-concurrency")
    ap.add_argument("--seconds", type=float, default=45.0, help="length of each phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cap-max-tokens", type=int, default=8)
    ap.add_argument("--hold", type=float, default=5.0, help="hysteresis hold seconds")
    ap.add_argument("--deadline", type=float, default=30.0, help="each call's deadline (s)")
    ap.add_argument("--quick", action="store_true", help="a short check that the bench works")
    ap.add_argument("--out", default=str(RESULTS / "overload.json"))
    args = ap.parse_args()
    # between phases: the engine idle and the level back at 0, which a TTFT spike holds for the
    # engines' 30 s latency window plus the hold
    args.settle = args.hold + 35.0
    if args.quick:
        args.capacity, args.seconds, args.max_tokens, args.hold = 4, 15.0, 16, 3.0
        args.cap_max_tokens, args.deadline, args.settle = 4, 20.0, 10.0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ts-overload-") as tmp:
        suite = Suite(Path(tmp) / "suite", SuitePorts.ephemeral(), say=lambda m: None,
                      engine_args=("--max-concurrency", str(args.capacity)))
        try:
            suite.start()
            result = asyncio.run(measure(suite, args))
        finally:
            suite.stop()
    result.update({"date": datetime.now(timezone.utc).isoformat(), "machine": machine_facts(),
                   "wall_seconds": round(time.monotonic() - started, 1),
                   "config": {"capacity": args.capacity, "burst_in_capacities": BURST, "seconds_per_phase": args.seconds,
                              "max_tokens": args.max_tokens, "cap_max_tokens": args.cap_max_tokens,
                              "queue_depth_threshold": args.capacity, "ttft_p99_threshold_s": 2.0,
                              "hold_seconds": args.hold, "deadline_s": args.deadline,
                              "settle_timeout_s": args.settle,
                              "quick": args.quick, "engine": "tokenserve up defaults, "
                              f"--max-concurrency {args.capacity}"}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"capacity: {result['capacity_requests_per_s']} requests/s")
    for name in ("unloaded", "ladder_on", "ladder_off"):
        ph = result[name]
        print(f"{name}: max level {ph['max_level']}, gateway RSS {ph['gateway_peak_rss_mb']} MB, "
              f"codes {ph['codes_seen']}, running at the end {ph['running_at_end']}")
        for tier, t in ph["tiers"].items():
            print(f"  {tier:<8} ok {t['ok']:>4} shed {t['shed']:>4} codes {t['codes']} "
                  f"ttft p50/p99 {t['ttft_p50_s']}/{t['ttft_p99_s']} s")
    print(f"premium p99 TTFT vs unloaded: {result['premium_p99_ttft_vs_unloaded']}; "
          f"{result['wall_seconds']} s")
    return 1 if any(result[n]["internal"] for n in ("capacity", "unloaded", "ladder_on",
                                                    "ladder_off")) else 0


if __name__ == "__main__":
    sys.exit(main())
