"""Speculative decoding (prompt lookup) through the public API: on vs off in the same run.

    python -m bench.speculative [--runs 3] [--max-tokens 192] [--concurrency 1,16]

Starts the whole suite (etcd, tokenizer, meter, engine, gateway: controlplane.launcher.Suite
on ephemeral ports), issues a premium-tier key and streams Chat requests through the gateway
with the SDK (tokenserve.client.AsyncClient). Workloads, greedy:
  - code_edit: rewrite a 60-line Python function with one small change (the answer copies
    most of the prompt);
  - tool_call: fill a JSON schema given in the prompt, its arguments' keys listed in the
    request (the answer copies the keys and writes its own values), one order per seed;
  - chat: free-form questions (little to copy).
Each at 1 and 16 concurrent streams, with `speculation` left to the engine (on) and turned
off per request, back to back, alternating which goes first. Both modes get the same prompts:
each (run, workload, concurrency, stream) has its own nonce in the first line, so no prompt is
shared across runs, workloads or streams. The engine runs its default configuration plus
`--no-prefix-caching`, so the second mode cannot find the first mode's prompts in the prefix
cache (nothing else would hit it: every prompt is unique); --engine-arg replaces those flags.

Output history (the engine also drafts from a tenant's earlier outputs): every (run,
workload, concurrency) group is sent by a tenant of its own, whose history starts empty.
That tenant first sends `--history-warmup` (6) other requests of the same workload with
speculation on, as a deployment that has served similar calls would have: other orders of the
same tool (seeds 100..105: other customers, cities, items, amounts, currencies, statuses,
discounts), other functions to edit (seeds 16..21; code_function repeats only every 30), other
questions (WARMUP_QUESTIONS). So when a measured 'on' request runs, its tenant's history holds
exactly those warm-up answers, plus, at 16 streams, the answers of the group's 'on' streams
that ended before it (other prompts). It never holds an answer to the request's own prompt:
'off' requests opt out of speculation and the engine neither drafts for nor records an
opted-out request, and the group's 'on' answer to a prompt joins the history only once that
request has ended. The history does not change 'off' requests at all.

Greedy output is the same either way (the engine guarantees it for the same prompt KV): the
bench compares every stream's tokens and token count between the two modes and reports the
agreement in the JSON (`output_check`), with the first differing position of any stream that
differs. At 1 stream each prompt is prefilled the same way in both modes and must match. At
16 the scheduler sizes prompt chunks from measured step times, and in the default
configuration (bfloat16 prefill, float16 KV cache) where a prompt's chunks split moves its KV
slightly, enough to flip a near tie (measured in-process: one of three tool-call prompts
prefilled in chunks of 100 instead of one parts at its 29th token, with no drafts at all), so
a difference there is not by itself a speculation bug.

Per stream: TTFT (send -> first token) and per-user tokens/s (completion tokens after the
first / time from first to last token); per workload: median per-user tok/s, aggregate tok/s
(tokens / wall time), p50 TTFT, and the draft acceptance rate from the engine's /metrics.
Medians over --runs. Writes bench/results/speculative.json (with bench.machine's facts: CPU
flags, copy bandwidth) and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.machine import machine_facts  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The engine's defaults, without the prefix cache (see the module docstring).
ENGINE_ARGS = ["--no-prefix-caching"]
TENANT = "bench-speculative"

# -- workloads --------------------------------------------------------------------------
_FIELDS = ["order_id", "customer", "amount", "currency", "status", "region", "created_at",
           "items", "discount", "notes"]


def code_function(seed: int) -> str:
    """A 60-line function, different per seed."""
    name = ["orders", "invoices", "shipments", "payments", "refunds", "tickets"][seed % 6]
    lines = [f"def summarize_{name}(records, threshold=10, verbose=False):",
             f'    """Group {name} by region and total the amounts above threshold."""',
             "    totals = {}", "    counts = {}", "    skipped = 0"]
    i = 0
    while len(lines) < 56:
        f = _FIELDS[(seed + i) % len(_FIELDS)]
        lines += [f"    for record in records:",
                  f"        value = record.get(\"{f}\")",
                  f"        if value is None or value < threshold + {i}:",
                  "            skipped += 1",
                  "            continue",
                  f"        totals[\"{f}\"] = totals.get(\"{f}\", 0) + value",
                  f"        counts[\"{f}\"] = counts.get(\"{f}\", 0) + 1"]
        i += 1
    lines += ["    if verbose:", "        print(f\"skipped {skipped} records\")",
              "    averages = {k: totals[k] / counts[k] for k in totals}", "    return totals, averages"]
    return "\n".join(lines[:60])


def code_edit(seed: int) -> list[dict]:
    return [{"role": "system", "content": "You are a coding assistant. Answer with code only."},
            {"role": "user", "content": "Rewrite this function with the parameter `threshold` renamed"
             f" to `minimum`; keep everything else the same.\n\n```python\n{code_function(seed)}\n```"}]


_CUSTOMERS = ["Ana Lopez", "Kenji Sato", "Maria Rossi", "Omar Haddad", "Lena Berg", "Tom Reed",
              "Priya Nair", "Jonas Weber", "Chloe Martin", "Diego Silva", "Amara Obi"]
_CITIES = ["Paris", "Osaka", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Dakar"]
_ITEMS = ["lamps", "chairs", "kettles", "backpacks", "monitors", "rugs", "bicycles"]
_CURRENCIES = ["EUR", "USD", "JPY", "GBP", "CHF"]
_STATUSES = ["pending", "paid", "shipped", "cancelled"]


def tool_call(seed: int) -> list[dict]:
    """One order per seed: customer, city, item, quantity, price, currency, status and
    discount all drawn from the seed, so two seeds' orders (and answers) differ in their
    values while sharing the tool's schema, as a deployment's calls of one tool do."""
    props = {f: {"type": "number" if f in ("amount", "discount") else "string",
                 "description": f"the {f.replace('_', ' ')} of the order"} for f in _FIELDS}
    schema = {"name": "create_order", "description": "Create an order in the shop system",
              "parameters": {"type": "object", "properties": props, "required": _FIELDS[:5]}}
    rng = random.Random(seed)
    order = (f"Customer {rng.choice(_CUSTOMERS)} in {rng.choice(_CITIES)} ordered"
             f" {rng.randint(2, 9)} {rng.choice(_ITEMS)} for {rng.randint(20, 900)}."
             f"{rng.randint(0, 99):02d} {rng.choice(_CURRENCIES)} today; order"
             f" {rng.randint(1000, 9999)}, status {rng.choice(_STATUSES)},"
             f" {rng.randint(0, 30)}% discount.")
    # The arguments' keys are listed in the request too: asked only to fill the schema,
    # SmolLM2-135M answers in prose (nothing to copy; not a tool call).
    arguments = json.dumps({f: "" for f in _FIELDS}, indent=2)
    return [{"role": "system", "content": "You call tools. Answer with one JSON object that"
             f" fills every field of this schema:\n{json.dumps(schema, indent=2)}"},
            {"role": "user", "content": f"Order: {order}\n\nCopy this JSON and fill in the"
             f" values from the order:\n```json\n{arguments}\n```"}]


CHAT_QUESTIONS = ["Why is the sky blue?", "Give me three tips for a job interview.",
                  "What should I cook tonight with rice and beans?",
                  "Explain how vaccines train the immune system.",
                  "Write a short poem about autumn rain.", "What makes a good team leader?",
                  "How do airplanes stay in the air?", "Suggest a weekend plan in a small town."]


# Asked only in the warm-up (a measured chat request never finds its own question answered).
WARMUP_QUESTIONS = ["What is a black hole?", "How do I start running?",
                    "Explain compound interest simply.", "Why do cats purr?",
                    "Write a haiku about the sea.", "What is the best way to learn a language?",
                    "How does a refrigerator work?", "Plan a picnic for four people."]


def chat(seed: int, questions: list[str] = CHAT_QUESTIONS) -> list[dict]:
    return [{"role": "system", "content": "You are a friendly assistant."},
            {"role": "user", "content": questions[seed % len(questions)]}]


WORKLOADS = {"code_edit": code_edit, "tool_call": tool_call, "chat": chat}
# Measured streams use seeds 0..15. The warm-up's prompts are other requests of the same kind:
# other functions (code_function repeats every 30 seeds), other orders, other questions.
WARMUP_SEED = 100
WARMUPS = {"code_edit": lambda s: code_edit(16 + s % 14), "tool_call": lambda s: tool_call(WARMUP_SEED + s),
           "chat": lambda s: chat(s, WARMUP_QUESTIONS)}


def with_nonce(messages: list[dict], nonce: str) -> list[dict]:
    """A unique first line, so no request reuses another's prompt from the prefix cache."""
    first = dict(messages[0], content=f"[session {nonce}] " + messages[0]["content"])
    return [first, *messages[1:]]


# -- measuring ---------------------------------------------------------------------------
async def one_stream(client, messages, max_tokens: int, speculation: bool | None) -> dict:
    opts = {} if speculation is None else {"speculation": speculation}
    t0 = time.perf_counter()
    first = last = None
    ids: list[int] = []
    async for chunk in client.chat(messages, max_tokens=max_tokens, temperature=0.0, **opts):
        if chunk.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            ids.extend(chunk.token_ids)
    tokens = len(ids)
    per_user = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return {"ttft_s": (first or time.perf_counter()) - t0, "tokens": tokens,
            "per_user_tok_s": per_user, "token_ids": ids}


def draft_counters(metrics_url: str) -> tuple[float, float]:
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def value(name):
        return sum(float(line.split()[-1]) for line in body.splitlines()
                   if line.startswith(name + " "))
    return (value("tokenserve_engine_draft_tokens_proposed_total"),
            value("tokenserve_engine_draft_tokens_accepted_total"))


async def run_load(target: str, key: str, metrics_url: str, workload: str, streams: int,
                   speculation: bool | None, max_tokens: int, nonce: str, make=None) -> dict:
    from tokenserve.client import AsyncClient

    make = make or WORKLOADS[workload]
    before = draft_counters(metrics_url)
    async with AsyncClient(target, key, timeout=600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[
            one_stream(client, with_nonce(make(i), f"{nonce}-{i}"), max_tokens, speculation)
            for i in range(streams)])
        wall = time.perf_counter() - t0
    after = draft_counters(metrics_url)
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    tokens = sum(r["tokens"] for r in res)
    return {"tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "per_user_tok_s": statistics.median(r["per_user_tok_s"] for r in res),
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in res),
            "draft_proposed": proposed, "draft_accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "streams": [r["token_ids"] for r in res]}


def compare_outputs(on: list[list[int]], off: list[list[int]]) -> dict:
    """Per stream of one load run in both modes: identical tokens, equal token counts, and
    where any stream first differs."""
    diffs = []
    for i, (a, b) in enumerate(zip(on, off)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"stream": i, "first_difference": at, "tokens_on": len(a),
                          "tokens_off": len(b)})
    return {"streams": len(on), "identical": len(on) - len(diffs),
            "same_token_counts": sum(len(a) == len(b) for a, b in zip(on, off)),
            "differences": diffs}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


async def create_tenants(endpoint: str, names: list[str]) -> None:
    from controlplane import admin
    from controlplane.store import ConfigStore

    store = ConfigStore([endpoint])
    try:
        for name in names:
            if await store.get(f"tenants/{name}") is None:
                await admin.create_tenant(store, name, "Speculative decoding bench", "premium",
                                          actor="bench")
    finally:
        await store.close()


def main(argv=None) -> int:
    from controlplane.launcher import Suite, SuitePorts
    from tokenserve.models import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--history-warmup", type=int, default=6,
                    help="warm-up requests (other prompts of the workload, speculation on) each"
                         " measured group's tenant sends first; 0: an empty history")
    ap.add_argument("--engine-arg", action="append", default=None,
                    help=f"engine flag, replacing the default {' '.join(ENGINE_ARGS)} (the"
                         " engine's own defaults otherwise)")
    ap.add_argument("--out", default=str(RESULTS / "speculative"))
    a = ap.parse_args(argv)
    engine_args = a.engine_arg if a.engine_arg is not None else ENGINE_ARGS
    conc = [int(c) for c in a.concurrency.split(",")]
    names = a.workloads.split(",")
    data = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    suite = Suite(data, SuitePorts.ephemeral(), engine_args=tuple(engine_args),
                  say=lambda m: print(m, flush=True))
    raw: dict[str, list[dict]] = {}
    checks: dict[str, list[dict]] = {}
    facts = machine_facts(default_model_path())
    print("machine:", {k: v for k, v in facts.items() if k != "cpu_flags"}, flush=True)
    groups = [(run, w, c) for run in range(a.runs) for w in names for c in conc]
    tenant = {g: f"{TENANT}-r{g[0]}-{g[1].replace('_', '-')}-c{g[2]}" for g in groups}
    try:
        suite.start()
        asyncio.run(create_tenants(suite.etcd_endpoint, [TENANT, *tenant.values()]))
        keys = {g: suite.issue_key(t) for g, t in tenant.items()}
        key = suite.issue_key(TENANT)
        target = suite.address("gateway")
        metrics_url = f"http://127.0.0.1:{suite.ports.engine_metrics}/metrics"
        time.sleep(1.5)  # the gateway sees the new keys through its etcd watch

        def load(w, c, spec, nonce, k=key, make=None):
            return asyncio.run(run_load(target, k, metrics_url, w, c, spec, a.max_tokens, nonce,
                                        make))

        load("chat", 2, None, "warmup")
        for run, w, c in groups:
            # this group's tenant has served only its warm-up: other requests of the
            # same kind, which the engine keeps in the tenant's output history
            if a.history_warmup:
                load(w, a.history_warmup, None, f"r{run}-{w}-{c}-warmup", keys[run, w, c],
                     WARMUPS[w])
            modes = [("on", None), ("off", False)]
            if run % 2:
                modes.reverse()  # neither mode always runs first
            streams = {}
            for mode, spec in modes:
                # the same nonce in both modes: the same prompts
                r = load(w, c, spec, f"r{run}-{w}-{c}", keys[run, w, c])
                streams[mode] = r.pop("streams")
                raw.setdefault(f"{w}/c{c}/{mode}", []).append(r)
                print(f"run {run} {w:9s} c={c:<2d} {mode:3s} per-user {r['per_user_tok_s']:6.1f}"
                      f" tok/s  aggregate {r['aggregate_tok_s']:6.1f} tok/s  ttft p50"
                      f" {r['ttft_p50_s']:.2f}s  acceptance {r['acceptance_rate']:.2f}"
                      f"  tokens {r['tokens']}", flush=True)
            check = compare_outputs(streams["on"], streams["off"])
            checks.setdefault(f"{w}/c{c}", []).append(check)
            print(f"run {run} {w:9s} c={c:<2d} outputs identical in"
                  f" {check['identical']}/{check['streams']} streams", flush=True)
    finally:
        suite.stop()

    results = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in raw.items()}
    ratios = {}
    for w in names:
        for c in conc:
            on, off = results.get(f"{w}/c{c}/on"), results.get(f"{w}/c{c}/off")
            if on and off:
                ratios[f"{w}/c{c}"] = {
                    "per_user_on_over_off": round(on["per_user_tok_s"] / off["per_user_tok_s"], 3),
                    "aggregate_on_over_off": round(on["aggregate_tok_s"] / off["aggregate_tok_s"], 3),
                    "ttft_on_over_off": round(on["ttft_p50_s"] / off["ttft_p50_s"], 3)}
    output_check = {g: {"streams": sum(c["streams"] for c in cs),
                        "identical": sum(c["identical"] for c in cs),
                        "same_token_counts": sum(c["same_token_counts"] for c in cs),
                        "differences": [d for c in cs for d in c["differences"]]}
                    for g, cs in checks.items()}
    report = {"benchmark": "speculative", "when": datetime.now(timezone.utc).isoformat(),
              "machine": {**facts, "cpu": cpu_model(), "platform": platform.platform(),
                          "load_avg_at_end": os.getloadavg()},
              "model": "SmolLM2-135M-Instruct Q4_1 (GGUF)", "engine_args": engine_args,
              "path": "SDK -> gateway -> engine (whole suite, premium tier), Chat, greedy",
              "runs": a.runs, "max_tokens": a.max_tokens, "history_warmup": a.history_warmup,
              "results": results,
              "ratios": ratios, "output_check": output_check, "raw": raw}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(report, indent=2))
    plot(results, names, conc, Path(a.out + ".png"))
    print(json.dumps(ratios, indent=2))
    print(json.dumps({g: {k: v for k, v in c.items() if k != "differences"}
                      for g, c in output_check.items()}, indent=2))
    return 0


def plot(results: dict, names: list[str], conc: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [f"{w}/c{c}" for w in names for c in conc]
    metrics = [("per_user_tok_s", "per-user tokens/s (median stream)"),
               ("aggregate_tok_s", "aggregate tokens/s"), ("ttft_p50_s", "p50 TTFT (s)"),
               ("acceptance_rate", "draft acceptance rate")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (key, title) in zip(axes, metrics):
        for i, mode in enumerate(("off", "on")):
            xs = [j + i * 0.4 for j in range(len(groups))]
            ax.bar(xs, [results.get(f"{g}/{mode}", {}).get(key, 0) for g in groups], 0.4,
                   label=f"speculation {mode}")
        ax.set_xticks([j + 0.2 for j in range(len(groups))], groups, rotation=30, ha="right")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("SmolLM2-135M through the gateway: prompt-lookup speculative decoding on vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
