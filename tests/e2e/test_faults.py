"""Faults under load, over `tokenserve up` (the real command, every service a real process):
etcd killed (serving goes on with the last good policy, tsctl fails readably, a change
applies within a second once etcd is back), the meter away under load (no usage lost or
counted twice, gateway and engine records reconcile), SIGTERM to the gateway during 20
streams and to the engine (running streams finish or end UNAVAILABLE, new ones are refused,
the usage spools are flushed).

One suite for the module; tests run in file order. Where an outage must outlast the load
whatever the machine's speed, the launcher is paused (SIGSTOP) so that it does not restart
the process before the test lets it.

The meter outage is `TOKENSERVE_TEST_METER_OUTAGE_S` seconds (default 5, to fit `make test`'s
budget); `bench/soak.py` keeps the meter away for 60 s.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from controlplane.service_process import ROOT
from tests.e2e.up_process import Up, alive, engine_idle, metric, wait_for
from tokenserve.engine.v1 import engine_pb2, engine_pb2_grpc
from tokenserve.gateway.v1 import gateway_pb2 as pb
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc

pytestmark = pytest.mark.slow

METER_OUTAGE_S = float(os.environ.get("TOKENSERVE_TEST_METER_OUTAGE_S", "5"))
TSCTL = [sys.executable, "-m", "controlplane.tsctl"]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    u = Up(tmp_path_factory.mktemp("faults"))
    try:
        u.start()
        # premium: 20 streams at once (standard allows 16), and never shed by the
        # degradation ladder when a loaded machine pushes TTFT past its threshold
        out = tsctl(u, "tenant", "set-tier", "demo", "premium")
        assert out.returncode == 0, out.stderr
        assert wait_for(lambda: rps_limit_seen(u) == "200", 30, 0.1)
        yield u
    finally:
        u.proc.send_signal(signal.SIGCONT)  # never leave the launcher paused
        u.stop()


@contextlib.contextmanager
def launcher_paused(up: Up):
    up.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        up.proc.send_signal(signal.SIGCONT)


@dataclass
class Outcome:
    request_id: str
    code: str
    details: str = ""
    tokens: int = 0          # token ids streamed to the client
    usage: tuple[int, int] | None = None  # (prompt, completion) in the last chunk
    ended_at: float = 0.0


@dataclass
class Load:
    """A steady loop of short Generate calls through the gateway, one at a time."""

    up: Up
    prefix: str
    max_tokens: int = 2
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        i = 0
        while not self._stop.is_set():
            self.outcomes.append(stream(self.up, f"{self.prefix}-{i}", self.max_tokens, 60))
            i += 1

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(120)
        return self.outcomes

    def wait_served_since(self, start: float, n: int, at_least: float) -> None:
        """Returns once at_least seconds passed and n requests ended since start (a loaded
        machine serves fewer per second)."""
        time.sleep(at_least)
        assert wait_for(lambda: len(self.between(start, time.monotonic())) >= n, 60)

    def between(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.ended_at <= end]


def stream(up: Up, request_id: str, max_tokens: int, timeout: float,
           prompt: str = "Hello", started: threading.Event | None = None) -> Outcome:
    out = Outcome(request_id, "OK")
    try:
        for chunk in up.api.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                                        request_id=request_id),
                                     metadata=up.auth, timeout=timeout):
            out.tokens += len(chunk.token_ids)
            if chunk.HasField("usage"):
                out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if started is not None:
                started.set()
    except grpc.RpcError as e:
        out.code, out.details = e.code().name, e.details() or ""
    finally:
        if started is not None:
            started.set()
    out.ended_at = time.monotonic()
    return out


def meter_rows(up: Up, source: int, request_ids: set[str]) -> list[dict[str, str]]:
    """Every row (duplicates included) of one source for request_ids."""
    with grpc.insecure_channel(up.address("meter")) as ch:
        csv = "".join(c.data for c in meter_pb2_grpc.MeterServiceStub(ch).ExportCsv(
            meter_pb2.QueryUsageRequest(source=source), timeout=30,
            metadata=(("authorization", f"Bearer {up.meter_token}"),)))
    header, *lines = csv.splitlines()
    rows = [dict(zip(header.split(","), line.split(","))) for line in lines]
    return [r for r in rows if r["request_id"] in request_ids]


def spools_empty(up: Up) -> bool:
    return all(metric(up, s, f"tokenserve_{s}_usage_spool_events") == 0
               for s in ("gateway", "engine"))


def tsctl(up: Up, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*TSCTL, "--endpoints", up.address("etcd"), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def rps_limit_seen(up: Up) -> str | None:
    """The requests/s limit the gateway applies to the demo key now (None: refused)."""
    call = up.api.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=1), metadata=up.auth,
                           timeout=30)
    try:
        list(call)
    except grpc.RpcError:
        return None
    return dict(call.initial_metadata()).get("x-ratelimit-limit-requests")


def test_etcd_killed_mid_load_serving_goes_on_tsctl_fails_readably_then_changes_apply(up):
    load = Load(up, "etcd-down")
    time.sleep(1.0)
    with launcher_paused(up):
        os.kill(up.state["etcd_pid"], signal.SIGKILL)
        killed = time.monotonic()
        load.wait_served_since(killed, 3, at_least=3.0)  # the load goes on with etcd gone
        out = tsctl(up, "tier", "show", "premium")
        assert out.returncode == 1, out
        assert f"etcd at {up.address('etcd')} is unreachable" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        down_until = time.monotonic()
    assert up.wait_output("etcd is serving again", 60), up.output()[-2000:]
    time.sleep(1.0)
    outcomes = load.stop()
    during = load.between(killed, down_until)
    assert len(during) >= 3, f"only {len(during)} requests while etcd was down"
    failed = [o for o in outcomes if o.code != "OK"]
    assert failed == [], failed[:5]
    print(f"etcd down {down_until - killed:.1f} s: {len(during)} requests served meanwhile,"
          f" {len(outcomes)} in all, none failed")

    # etcd back: a tier change applies at the gateway within a second
    assert rps_limit_seen(up) == "200"
    out = wait_for(lambda: (r := tsctl(up, "tier", "set", "premium", "--rps", "37"))
                   .returncode == 0 and r, 30)
    assert out, "tsctl could not write once etcd was back"
    written = time.monotonic()
    # the start of the first request that saw it: on a loaded machine one request takes
    # longer than the change does to apply
    polled = []
    assert wait_for(lambda: polled.append(time.monotonic()) or rps_limit_seen(up) == "37",
                    10, 0.02)
    applied = polled[-1] - written
    print(f"tier change applied at the gateway {applied * 1000:.0f} ms after tsctl wrote it"
          f" (seen by the request started then; it ended"
          f" {(time.monotonic() - written) * 1000:.0f} ms after)")
    assert applied <= 1.5
    assert tsctl(up, "tier", "set", "premium", "--rps", "200").returncode == 0
    assert wait_for(lambda: rps_limit_seen(up) == "200", 10, 0.05)


def test_meter_away_under_load_then_back_no_usage_lost_or_counted_twice(up):
    assert wait_for(lambda: spools_empty(up), 30)
    load = Load(up, "meter-down", max_tokens=3)
    time.sleep(1.0)
    with launcher_paused(up):
        os.kill(up.state["pids"]["meter"], signal.SIGKILL)
        killed = time.monotonic()
        load.wait_served_since(killed, 3, at_least=METER_OUTAGE_S)
        outage = time.monotonic() - killed
        spooled = metric(up, "gateway", "tokenserve_gateway_usage_spool_events")
    assert up.wait_output("meter is serving again", 60), up.output()[-2000:]
    time.sleep(1.0)
    outcomes = load.stop()
    during = load.between(killed, killed + outage)
    assert len(during) >= 3 and spooled >= len(during) - 1, (len(during), spooled)
    assert [o for o in outcomes if o.code != "OK"] == []

    assert wait_for(lambda: spools_empty(up), 60), "the spools never drained"
    ids = {o.request_id for o in outcomes}
    gateway = meter_rows(up, meter_pb2.SOURCE_GATEWAY, ids)
    engine = meter_rows(up, meter_pb2.SOURCE_ENGINE, ids)
    for rows, source in ((gateway, "gateway"), (engine, "engine")):
        by_id: dict[str, list] = {}
        for r in rows:
            by_id.setdefault(r["request_id"], []).append(r)
        assert set(by_id) == ids, f"{source}: {len(ids - set(by_id))} requests lost"
        assert [i for i, rs in by_id.items() if len(rs) > 1] == [], f"{source}: counted twice"
    # what the gateway answered (the usage in each last chunk) is what the meter holds
    served = {o.request_id: o.usage for o in outcomes}
    metered = {r["request_id"]: (int(r["prompt_tokens"]), int(r["completion_tokens"]))
               for r in gateway}
    assert metered == served
    totals = [sum(u[i] for u in served.values()) for i in (0, 1)]
    print(f"meter away {outage:.1f} s: {len(during)} requests spooled meanwhile;"
          f" {len(ids)} requests, {totals[0]} prompt + {totals[1]} completion tokens, equal in"
          f" the gateway's answers, the meter's gateway rows and its engine rows")
    report = reconcile(up)
    assert report["drift"] == 0 and report["mismatches"] == [], report
    assert report["matched"] >= len(ids)


def reconcile(up: Up) -> dict:
    out = subprocess.run([*TSCTL, "usage", "--meter", up.address("meter"), "reconcile",
                          "--since", "1h", "--json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT,
                         env={**os.environ, "TOKENSERVE_METER_TOKEN": up.meter_token})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def spool_file_rows(path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT COUNT(*) FROM spool").fetchone()[0]


# A long stream's max_tokens: far past what a drain's 6 s can finish, however fast the engine
# (three 1,000-token streams beside three short ones once completed within it on the AMX
# Xeon); within the premium tier's 4,096.
LONG = 4000


def streams_then_sigterm(up: Up, service: str, lengths: list[int], meanwhile=None):
    """Streams through the gateway, one per max_tokens in `lengths`; SIGTERM to `service`
    once each has a token; a new stream 0.2 s after (then `meanwhile()`, while it drains).
    Returns (outcomes, the new stream's outcome, when SIGTERM was sent, seconds from it to
    the exit)."""
    started = {f"{service}-term-{i}": threading.Event() for i in range(len(lengths))}
    outcomes: dict[str, Outcome] = {}

    def run(rid, max_tokens):
        outcomes[rid] = stream(up, rid, max_tokens, 120, "Count from 1 to 1000: 1, 2, 3, 4, 5,",
                               started[rid])

    threads = [threading.Thread(target=run, args=(rid, n), daemon=True)
               for rid, n in zip(started, lengths)]
    for t in threads:
        t.start()
    for rid, ev in started.items():
        assert ev.wait(120), f"{rid} never started"
    pid = up.state["pids"][service]
    os.kill(pid, signal.SIGTERM)
    termed = time.monotonic()
    time.sleep(0.2)
    late = stream(up, f"{service}-after-term", 4, 10)
    assert late.ended_at - termed < 5, "a stream started after SIGTERM hung"
    if meanwhile is not None:
        meanwhile()
    for t in threads:
        t.join(60)
    if not wait_for(lambda: not alive(pid), 60, 0.05):  # what it was doing, for the report
        raise AssertionError(f"the {service} did not exit; the end of its log:\n" + log_tail(up, service))
    return outcomes, late, termed, time.monotonic() - termed


def log_tail(up: Up, service: str, lines: int = 120) -> str:
    log = (up.data_dir / "var" / "logs" / f"{service}.log").read_text(errors="replace")
    return "\n".join(log.splitlines()[-lines:])


@contextlib.contextmanager
def exits_cleanly(up: Up, service: str):
    """Around a SIGTERM to `service` (and the launcher's pause): the launcher then reports its
    exit with status 0, not the stop deadline's 70 (a stop that hung)."""
    said = f"{service} exited with code "
    before = up.output().count(said)
    yield
    assert up.wait_output_count(said, before + 1, 30), up.output()[-2000:]
    code = up.output().rsplit(said, 1)[-1].split(";")[0].strip()
    assert code == "0", f"the {service} exited with code {code}; the end of its log:\n" + log_tail(up, service)


def test_sigterm_to_the_gateway_during_20_streams(up):
    with exits_cleanly(up, "gateway"), launcher_paused(up):
        # half short, half far longer than the grace period (cut at its end)
        outcomes, late, termed, exited = streams_then_sigterm(up, "gateway", [8, LONG] * 10)
        # drain 1 s + grace 5 s: every stream ended by then, completed or UNAVAILABLE
        assert len(outcomes) == 20
        codes = {rid: o.code for rid, o in outcomes.items()}
        # (on a loaded machine a short one may be cut too; a long one always is)
        assert set(codes.values()) <= {"OK", "UNAVAILABLE"} and "UNAVAILABLE" in codes.values()
        assert max(o.ended_at for o in outcomes.values()) - termed < 6 + 1.5
        assert late.code == "UNAVAILABLE", late
        # the spool was flushed on the way out: empty file, every stream's usage in the meter
        assert spool_file_rows(up.data_dir / "var" / "gateway-spool.db") == 0
        rows = meter_rows(up, meter_pb2.SOURCE_GATEWAY, set(outcomes))
        assert {r["request_id"] for r in rows} == set(outcomes)
        for r in rows:
            o = outcomes[r["request_id"]]
            assert r["status"] == o.code and int(r["completion_tokens"]) >= o.tokens, (r, o)
        ok = list(codes.values()).count("OK")
        print(f"gateway SIGTERM: {ok} of 20 streams completed, {20 - ok} UNAVAILABLE; exited"
              f" {exited:.1f} s after; new stream: {late.code} ({late.details})")
    assert up.wait_output("gateway is serving again", 120), up.output()[-2000:]
    assert wait_for(lambda: stream(up, "after-gateway-back", 2, 30).code == "OK", 30)


def direct_call_refused(up: Up) -> None:
    """The draining engine called directly: UNAVAILABLE, saying it drains."""
    with grpc.insecure_channel(up.address("engine")) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(engine_pb2_grpc.EngineServiceStub(ch).Generate(
                engine_pb2.GenerateRequest(prompt_token_ids=[7], max_tokens=2), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in err.value.details(), err.value.details()


def test_sigterm_to_the_engine_drains(up):
    with exits_cleanly(up, "engine"), launcher_paused(up):
        engine = up.address("engine")
        outcomes, late, termed, exited = streams_then_sigterm(
            up, "engine", [8, LONG] * 3, meanwhile=lambda: direct_call_refused(up))
        codes = {rid: o.code for rid, o in outcomes.items()}
        # (on a loaded machine a short one may be cut too; a long one always is)
        assert set(codes.values()) <= {"OK", "UNAVAILABLE"} and "UNAVAILABLE" in codes.values()
        for o in outcomes.values():
            if o.code == "UNAVAILABLE":
                assert f"engine {engine}" in o.details, o.details
        assert max(o.ended_at for o in outcomes.values()) - termed < 6 + 1.5
        assert late.code == "UNAVAILABLE" and "engine" in late.details, late
        ok = list(codes.values()).count("OK")
        print(f"engine SIGTERM: {ok} of 6 streams completed, {6 - ok} UNAVAILABLE; exited"
              f" {exited:.1f} s after; new stream: {late.code} ({late.details})")
        assert spool_file_rows(up.data_dir / "var" / "engine-spool.db") == 0
        # the engine recorded the streams cut by its exit too (as cancelled): they reconcile
        assert wait_for(lambda: {r["request_id"] for r in meter_rows(
            up, meter_pb2.SOURCE_ENGINE, set(outcomes))} == set(outcomes), 30)
        report = reconcile(up)
        assert report["drift"] == 0 and report["mismatches"] == [], report
    assert up.wait_output("engine is serving again", 300), up.output()[-2000:]
    assert wait_for(lambda: stream(up, "after-engine-back", 2, 30).code == "OK", 60)
    assert wait_for(lambda: engine_idle(up), 30)
