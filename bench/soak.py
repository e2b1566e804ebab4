"""A compressed soak: mixed load against `tokenserve up` with one fault injected every minute.

    python bench/soak.py [--minutes 10] [--meter-outage 60] [--out bench/results/soak]
                         [--faults meter,engine,etcd,tokenizer,gateway] [--slot 60]

The suite is the real `tokenserve up` command (its launcher supervises: a crashed process is
restarted with backoff), on free ports, with the real SmolLM2. Load: --workers closed-loop
clients, each request drawn at random: gRPC Generate or Chat (70%) or the HTTP API (30%),
one of three tenants on the free / standard / premium tiers, and one of: a normal request
(max_tokens 4-16), a cancel after the first token (gRPC cancel; HTTP: the client leaves after
the first event) or a short deadline (0.3 s). Every request has its own request id.

Faults, one at the start of each minute, in turn (then again from the first):

- meter: SIGKILL, and the launcher paused for --meter-outage seconds (60: the issue's
  outage) so that it cannot restart it sooner; that fault's slot lasts the outage + 15 s;
- engine: SIGKILL (the launcher restarts it; requests are UNAVAILABLE until it serves);
- etcd: SIGKILL (restarted by the launcher; requests go on with the last good policy);
- tokenizer: SIGKILL (the gateway encodes in its own process where it can);
- gateway: SIGTERM (it drains and exits; the launcher starts it again).

Redis is not part of `tokenserve up` (its gateway counts quotas in memory): its fault is
tests/integration/gateway/test_redis_faults.py.

Recorded per fault: when it was injected, when the faulted process answered again
(`service_back_s`), the first request started after the fault that succeeded
(`first_ok_request_s`, when it ended: it includes that request's own time), and the status
counts of requests that ended in the slot. At the end, once the
spools drained: lost usage (a request that streamed tokens or finished OK with no gateway
row in the meter, or with fewer tokens than the client saw), usage counted twice (two rows
of one request id from one source), the meter's Reconcile of gateway vs engine records (an
engine SIGKILLed mid-stream takes its unsent records with it: those show as missing_engine
for requests the gateway ended UNAVAILABLE, and are listed apart), INTERNAL/UNKNOWN and
HTTP 500 counts (must be zero), counts of every status. Writes OUT.json and OUT.png (requests
per second by status over time, faults marked) with the machine's facts (CPU flags).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_facts  # noqa: E402
from tokenserve.common.v1 import common_pb2  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2 as pb  # noqa: E402
from tokenserve.gateway.v1 import gateway_pb2_grpc  # noqa: E402
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc  # noqa: E402
from tokenserve.models import default_model_path  # noqa: E402

FAULTS = ("meter", "engine", "etcd", "tokenizer", "gateway")
TIERS = ("free", "standard", "premium")
TSCTL = [sys.executable, "-m", "controlplane.tsctl"]
PROMPTS = ("Tell me about lighthouses.", "Count from 1 to 20:", "What is the capital of France?",
           "Write a haiku about rain.")
HTTP_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
              404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
              499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


@dataclass
class Result:
    request_id: str
    protocol: str
    tier: str
    kind: str       # normal | cancel | deadline
    started: float  # seconds since the load began
    ended: float
    status: str     # a gRPC code name; HTTP answers mapped to one (HTTP_<n> when unmapped)
    tokens: int = 0  # token ids (gRPC) or events (HTTP) the client received
    usage: tuple[int, int] | None = None  # (prompt, completion) of a finished answer
    detail: str = ""


class UpProcess:
    """`tokenserve up --ephemeral-ports` as a subprocess: its output, up.json, its key."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.var = data_dir / "var"
        self.out_path = data_dir / "up.out"
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.launcher", "up", "--ephemeral-ports",
             "--data-dir", str(self.var)], cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_up(self, timeout: float = 900) -> None:
        end = time.monotonic() + timeout
        while "Press Ctrl-C to stop." not in self.output():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("tokenserve up did not start:\n" + self.output()[-3000:])
            time.sleep(0.5)

    @property
    def state(self) -> dict:
        return json.loads((self.var / "up.json").read_text())

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.state['ports'][name]}"

    @property
    def meter_token(self) -> str:
        return (self.var / "meter-token").read_text().strip()

    def tsctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*TSCTL, "--endpoints", self.address("etcd"), *args],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.out.close()


class Load:
    def __init__(self, up: UpProcess, keys: dict[str, str], workers: int, seed: int):
        self.up, self.keys = up, keys
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()
        self.counter = 0
        self.rng = random.Random(seed)
        self.channel = grpc.insecure_channel(up.address("gateway"))
        self.api = gateway_pb2_grpc.InferenceServiceStub(self.channel)
        self.http_port = up.state["ports"]["gateway_http"]
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(workers)]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self):
        for t in self.threads:
            t.start()

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(120)
        self.channel.close()

    def _draw(self):
        with self.lock:
            self.counter += 1
            n = self.counter
            r = self.rng
            protocol = "grpc" if r.random() < 0.7 else "http"
            tier = r.choice(TIERS)
            kind = r.choices(("normal", "cancel", "deadline"), (0.7, 0.15, 0.15))[0]
            return (f"soak-{n}", protocol, tier, kind, r.randint(4, 16), r.choice(PROMPTS),
                    r.random() < 0.5)

    def _worker(self):
        while not self.stop_event.is_set():
            rid, protocol, tier, kind, max_tokens, prompt, chat = self._draw()
            res = Result(rid, protocol, tier, kind, self.now(), 0.0, "OK")
            try:
                if protocol == "grpc":
                    self._grpc(res, self.keys[tier], max_tokens, prompt, chat)
                else:
                    self._http(res, self.keys[tier], max_tokens, prompt)
            except Exception as e:  # noqa: BLE001 - a client-side failure is a result too
                res.status, res.detail = "CLIENT_ERROR", f"{type(e).__name__}: {e}"[:200]
            res.ended = self.now()
            with self.lock:
                self.results.append(res)
            # as a client would: back off after a refusal (an engine down answers at once)
            time.sleep(0.5 if res.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") else 0.05)

    def _grpc(self, res: Result, key: str, max_tokens: int, prompt: str, chat: bool):
        md = (("authorization", f"Bearer {key}"),)
        timeout = 0.3 if res.kind == "deadline" else 60
        if chat:
            call = self.api.Chat(pb.ChatRequest(
                messages=[common_pb2.ChatMessage(role="user", content=prompt)],
                max_tokens=max_tokens, request_id=res.request_id), metadata=md, timeout=timeout)
        else:
            call = self.api.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                                        request_id=res.request_id),
                                     metadata=md, timeout=timeout)
        try:
            for chunk in call:
                res.tokens += len(chunk.token_ids)
                if chunk.HasField("usage"):
                    res.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                if res.kind == "cancel" and res.tokens:
                    call.cancel()
                    res.status = "CANCELLED"
                    return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and res.kind == "cancel":
                res.status = "CANCELLED"
                return
            res.status, res.detail = e.code().name, (e.details() or "")[:200]

    def _http(self, res: Result, key: str, max_tokens: int, prompt: str):
        stream = res.kind == "cancel"
        body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "stream": stream})
        timeout = 0.3 if res.kind == "deadline" else 60
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"authorization": f"Bearer {key}", "content-type": "application/json",
                          "x-request-id": res.request_id})
            resp = conn.getresponse()
            res.status = HTTP_CODES.get(resp.status, f"HTTP_{resp.status}")
            if resp.status != 200:
                res.detail = resp.read()[:200].decode(errors="replace")
                return
            if stream:
                line = resp.readline()
                if line.startswith(b"data: "):
                    res.tokens = 1  # an event arrived; the client leaves mid-stream
                res.status = "CANCELLED"
                return
            answer = json.loads(resp.read())
            u = answer.get("usage") or {}
            res.usage = (u.get("prompt_tokens", 0), u.get("completion_tokens", 0))
            res.tokens = res.usage[1]
        except (TimeoutError, OSError) as e:
            # the client's own deadline passed (HTTP has no deadline header): it left
            res.status = "CLIENT_TIMEOUT" if isinstance(e, TimeoutError) else "CONNECTION_ERROR"
            res.detail = type(e).__name__
        finally:
            conn.close()


# -- probes of each faulted path --------------------------------------------------------

def health_ok(target: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1).status == 1
        except grpc.RpcError:
            return False


def etcd_read_ok(up: UpProcess) -> bool:
    from aetcd import rpc

    with grpc.insecure_channel(up.address("etcd")) as ch:
        try:
            rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"/tokenserve/v1/tiers/standard"),
                                 timeout=1)
            return True
        except grpc.RpcError:
            return False


def meter_query_ok(up: UpProcess) -> bool:
    with grpc.insecure_channel(up.address("meter")) as ch:
        try:
            meter_pb2_grpc.MeterServiceStub(ch).QueryUsage(
                meter_pb2.QueryUsageRequest(tenant_id="soak-premium"), timeout=2,
                metadata=(("authorization", f"Bearer {up.meter_token}"),))
            return True
        except grpc.RpcError:
            return False


def spool_events(up: UpProcess, service: str) -> float | None:
    port = up.state["ports"][f"{service}_metrics"]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(f"tokenserve_{service}_usage_spool_events "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def wait_until(predicate, timeout: float, interval: float = 0.1) -> float | None:
    """Seconds until predicate() held (None: not within timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval)
    return None


def inject(up: UpProcess, kind: str, meter_outage: float) -> dict:
    """Injects one fault; returns once the faulted process answers again (or 120 s passed)."""
    state = up.state
    rec: dict = {"kind": kind}
    if kind == "meter":
        up.proc.send_signal(signal.SIGSTOP)  # no restart during the outage
        try:
            os.kill(state["pids"]["meter"], signal.SIGKILL)
            rec["signal"] = "SIGKILL"
            time.sleep(meter_outage)
        finally:
            up.proc.send_signal(signal.SIGCONT)
        rec["outage_s"] = meter_outage
        back = wait_until(lambda: meter_query_ok(up), 120)
        rec["service_back_s"] = None if back is None else round(meter_outage + back, 2)
        return rec
    if kind == "etcd":
        os.kill(state["etcd_pid"], signal.SIGKILL)
        rec["signal"] = "SIGKILL"
        back = wait_until(lambda: etcd_read_ok(up), 120)
    elif kind == "gateway":
        os.kill(state["pids"]["gateway"], signal.SIGTERM)
        rec["signal"] = "SIGTERM"
        time.sleep(0.5)  # it drains (health NOT_SERVING), then exits and is restarted
        back = wait_until(lambda: health_ok(up.address("gateway"))
                          and up.state["pids"]["gateway"] != state["pids"]["gateway"], 180)
        back = None if back is None else back + 0.5
    else:  # engine, tokenizer
        os.kill(state["pids"][kind], signal.SIGKILL)
        rec["signal"] = "SIGKILL"
        back = wait_until(lambda: up.state["pids"][kind] != state["pids"][kind]
                          and health_ok(up.address(kind)), 300)
    rec["service_back_s"] = None if back is None else round(back, 2)
    return rec


# -- the run ----------------------------------------------------------------------------

def setup_tenants(up: UpProcess) -> dict[str, str]:
    keys = {}
    for tier in TIERS:
        tenant = f"soak-{tier}"
        out = up.tsctl("tenant", "create", tenant, "--tier", tier)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        out = up.tsctl("--json", "key", "issue", tenant)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        keys[tier] = json.loads(out.stdout)["key"]
    time.sleep(1.5)  # the gateway's watch delivers the new tenants and keys
    return keys


def meter_rows(up: UpProcess, source: int) -> list[dict[str, str]]:
    with grpc.insecure_channel(up.address("meter")) as ch:
        csv = "".join(c.data for c in meter_pb2_grpc.MeterServiceStub(ch).ExportCsv(
            meter_pb2.QueryUsageRequest(source=source), timeout=60,
            metadata=(("authorization", f"Bearer {up.meter_token}"),)))
    header, *lines = csv.splitlines()
    return [dict(zip(header.split(","), line.split(","))) for line in lines]


def usage_check(up: UpProcess, results: list[Result], engine_kill_windows) -> dict:
    drained = wait_until(lambda: spool_events(up, "gateway") == 0
                         and spool_events(up, "engine") == 0, 180, 0.5)
    gateway = [r for r in meter_rows(up, meter_pb2.SOURCE_GATEWAY)
               if r["request_id"].startswith("soak-")]
    engine = [r for r in meter_rows(up, meter_pb2.SOURCE_ENGINE)
              if r["request_id"].startswith("soak-")]
    by_id = {}
    for r in gateway:
        by_id.setdefault(r["request_id"], []).append(r)
    eng_ids = Counter(r["request_id"] for r in engine)
    lost, short, mismatched = [], [], []
    for res in results:
        rows = by_id.get(res.request_id, [])
        must = res.status == "OK" or res.tokens > 0
        if must and not rows:
            lost.append(res.request_id)
            continue
        if rows and res.protocol == "grpc" and int(rows[0]["completion_tokens"]) < res.tokens:
            short.append(res.request_id)
        if rows and res.status == "OK" and res.usage is not None:
            if (int(rows[0]["prompt_tokens"]), int(rows[0]["completion_tokens"])) != res.usage:
                mismatched.append(res.request_id)
    served_tokens = sum(sum(r.usage) for r in results if r.status == "OK" and r.usage)
    metered_ok = sum(int(rows[0]["prompt_tokens"]) + int(rows[0]["completion_tokens"])
                     for res in results if res.status == "OK" and res.usage
                     and (rows := by_id.get(res.request_id)))
    out = subprocess.run([*TSCTL, "usage", "--meter", up.address("meter"), "reconcile",
                          "--since", "6h", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT,
                         env={**os.environ, "TOKENSERVE_METER_TOKEN": up.meter_token})
    report = json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}
    statuses = {res.request_id: res for res in results}
    expected, unexpected = [], []
    for m in report.get("mismatches", []):
        res = statuses.get(m["request_id"])
        cut = (m["kind"] == "missing_engine" and res is not None
               and any(a <= res.ended <= b for a, b in engine_kill_windows))
        if not cut:  # what the client saw and what the gateway billed, to tell why
            gw = (by_id.get(m["request_id"]) or [{}])[0]
            m = {**m, "client": asdict(res) if res is not None else None,
                 "gateway_row": {k: gw.get(k) for k in ("status", "prompt_tokens",
                                                        "completion_tokens", "finish_reason")}}
        (expected if cut else unexpected).append(m)
    return {
        "spools_drained_after_s": drained,
        "gateway_rows": len(gateway), "engine_rows": len(engine),
        "lost": lost, "completion_below_streamed": short, "tokens_mismatched": mismatched,
        "counted_twice_gateway": sorted(i for i, rs in by_id.items() if len(rs) > 1),
        "counted_twice_engine": sorted(i for i, n in eng_ids.items() if n > 1),
        "ok_tokens_answered": served_tokens, "ok_tokens_metered": metered_ok,
        "reconcile": {k: v for k, v in report.items() if k != "mismatches"},
        "reconcile_expected_engine_kill": expected,
        "reconcile_unexpected": unexpected,
    }


def timeline(results: list[Result], seconds: float, step: float = 5.0) -> dict:
    bins = int(seconds // step) + 1
    by_status: dict[str, list[float]] = {}
    for r in results:
        b = min(bins - 1, int(r.ended // step))
        by_status.setdefault(r.status, [0.0] * bins)[b] += 1 / step
    return {"step_s": step, "per_s": by_status}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for status, per_s in sorted(tl["per_s"].items(), key=lambda kv: -sum(kv[1])):
        ax.plot([i * tl["step_s"] for i in range(len(per_s))], per_s, label=status, lw=1.2)
    for f in result["faults"]:
        ax.axvline(f["at_s"], color="black", ls="--", lw=0.8)
        ax.text(f["at_s"], ax.get_ylim()[1] * 0.95, f" {f['kind']}", fontsize=8, va="top")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("requests / s (by end time)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(f"soak: {result['config']['minutes']} min, a fault each minute;"
                 f" lost usage {result['usage']['lost_count']},"
                 f" INTERNAL/UNKNOWN {result['internal_or_unknown']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=10, help="fault slots (one fault each)")
    ap.add_argument("--meter-outage", type=float, default=60.0,
                    help="seconds the meter stays down (its slot: this + 15 s)")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help="the faults' order, comma-separated (default: %(default)s)")
    ap.add_argument("--slot", type=float, default=60.0,
                    help="seconds between faults (a quick check of the harness may shorten it)")
    ap.add_argument("--workers", type=int, default=4, help="closed-loop clients")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"),
                    help="output path without extension (.json and .png are written)")
    ap.add_argument("--data-dir", help="where tokenserve up writes (default: a temporary folder)")
    args = ap.parse_args()
    order = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not order or set(order) - set(FAULTS):
        ap.error(f"--faults: choose from {', '.join(FAULTS)}")

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="soak-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"starting tokenserve up in {data_dir}", flush=True)
    up = UpProcess(data_dir)
    faults: list[dict] = []
    try:
        up.wait_up()
        keys = setup_tenants(up)
        load = Load(up, keys, args.workers, args.seed)
        load.start()
        time.sleep(5)  # the load settles before the first fault
        for i in range(args.minutes):
            kind = order[i % len(order)]
            slot = max(args.slot, args.meter_outage + 15) if kind == "meter" else args.slot
            slot_start = load.now()
            print(f"[{slot_start:6.1f} s] fault {i + 1}/{args.minutes}: {kind}", flush=True)
            rec = inject(up, kind, args.meter_outage)
            rec["at_s"] = round(slot_start, 2)
            # the first request started after the fault that succeeded
            while load.now() - slot_start < slot:
                time.sleep(0.5)
            with load.lock:
                in_slot = [r for r in load.results if slot_start <= r.ended < slot_start + slot]
                after = sorted((r for r in load.results if r.started >= slot_start
                                and r.status == "OK"), key=lambda r: r.ended)
            rec["first_ok_request_s"] = round(after[0].ended - slot_start, 2) if after else None
            rec["slot_s"] = slot
            rec["statuses"] = dict(Counter(r.status for r in in_slot))
            rec["restarts_so_far"] = up.state.get("restarts", {})
            print(f"    {json.dumps(rec)}", flush=True)
            faults.append(rec)
        seconds = load.now()
        load.stop()
        results = load.results
        windows = [(f["at_s"], f["at_s"] + f["slot_s"]) for f in faults if f["kind"] == "engine"]
        print("load stopped; checking usage", flush=True)
        usage = usage_check(up, results, windows)
        usage["lost_count"] = len(usage["lost"])
        counts = Counter(r.status for r in results)
        internal = sum(counts.get(s, 0) for s in ("INTERNAL", "UNKNOWN"))
        result = {
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": {"minutes": args.minutes, "meter_outage_s": args.meter_outage,
                       "workers": args.workers, "seed": args.seed,
                       "slot_s": args.slot, "fault_order": order, "redis": "not used by tokenserve up"
                       " (memory quota store); see tests/integration/gateway/test_redis_faults.py"},
            "machine": machine_facts(default_model_path()),
            "seconds": round(seconds, 1),
            "requests": len(results),
            "statuses": dict(counts),
            "by_protocol": {p: dict(Counter(r.status for r in results if r.protocol == p))
                            for p in ("grpc", "http")},
            "by_kind": {k: dict(Counter(r.status for r in results if r.kind == k))
                        for k in ("normal", "cancel", "deadline")},
            "internal_or_unknown": internal,
            "http_500": sum(r.protocol == "http" and r.status == "INTERNAL" for r in results),
            "faults": faults,
            "usage": usage,
            "launcher_restarts": up.state.get("restarts", {}),
            "examples": {s: asdict(next(r for r in results if r.status == s))
                         for s in counts if s != "OK"},
        }
        result["timeline"] = timeline(results, seconds)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, out.with_suffix(".png"))
        ok = (internal == 0 and usage["lost_count"] == 0 and not usage["counted_twice_gateway"]
              and not usage["counted_twice_engine"] and not usage["reconcile_unexpected"]
              and not usage["completion_below_streamed"] and not usage["tokens_mismatched"])
        print(json.dumps({k: result[k] for k in ("requests", "statuses", "internal_or_unknown")}))
        print(json.dumps({k: usage[k] for k in ("lost_count", "counted_twice_gateway",
                                                "counted_twice_engine", "reconcile",
                                                "reconcile_unexpected")}))
        for f in faults:
            print(f"  {f['kind']:9} back {f['service_back_s']} s, first OK request"
                  f" {f['first_ok_request_s']} s, {f['statuses']}")
        print(f"wrote {out.with_suffix('.json')} and .png; {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        up.stop()


if __name__ == "__main__":
    sys.exit(main())
