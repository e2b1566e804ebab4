"""A batch is all or nothing even when the meter dies in the middle of it, and replicas on
one PostgreSQL count each event once however their batches overlap."""
from __future__ import annotations

import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tokenserve.runtime.ports import free_port
from controlplane.service_process import ServiceProcess
from tokenserve.meter.v1 import meter_pb2 as pb
from tokenserve.meter.v1 import meter_pb2_grpc

NOW = time.time()
N = 500


def start_meter(tmp_path, db: str, name: str = "meter") -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", db],
                          port, log_path=tmp_path / f"{name}.log").start()


def batch(ids) -> pb.RecordUsageRequest:
    return pb.RecordUsageRequest(events=[pb.UsageEvent(
        event_id=f"ev-{i:05d}", request_id=f"r-{i:05d}", source=pb.SOURCE_GATEWAY,
        tenant_id="acme", model="m", model_version="v1", tier="free", prompt_tokens=3,
        completion_tokens=2, status="OK", started_at=NOW - 2, finished_at=NOW - 1)
        for i in ids])


def stored(stub) -> int:
    rows = stub.QueryUsage(pb.QueryUsageRequest(), timeout=30).rows
    return rows[0].requests if rows else 0


def wait_until(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def hold_meter_mid_batch_sqlite(db: str):
    """The last row of the batch fires a trigger that runs for minutes: the meter sits inside
    its batch transaction, the earlier rows written but not committed."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"CREATE TRIGGER hold AFTER INSERT ON usage_events"
                 f" WHEN NEW.event_id = 'ev-{N - 1:05d}' BEGIN"
                 " SELECT COUNT(*) FROM usage_events a, usage_events b, usage_events c; END")

    def inside_batch() -> bool:
        try:
            conn.execute("BEGIN IMMEDIATE")  # refused while the meter holds the write lock
        except sqlite3.OperationalError:
            return True
        conn.execute("ROLLBACK")
        return False

    conn.execute("PRAGMA busy_timeout=0")
    return inside_batch, lambda: (conn.execute("DROP TRIGGER hold"), conn.close())


def hold_meter_mid_batch_postgres(url: str):
    """Another transaction holds the batch's last event id (uncommitted): the meter inserts
    the rows before it, then waits on that row's lock inside its batch transaction."""
    import psycopg

    holder = psycopg.connect(url)
    holder.execute("INSERT INTO usage_events (event_id, request_id, source, tenant_id, app,"
                   " model, model_version, tier, prompt_tokens, completion_tokens,"
                   " cached_tokens, status, started_at, finished_at, energy_joules,"
                   " energy_estimated) VALUES (%s, 'x', 'gateway', 'acme', '', '', '', '',"
                   " 0, 0, 0, 'OK', 0, 0, 0, 0)", (f"ev-{N - 1:05d}",))
    watcher = psycopg.connect(url, autocommit=True)

    def inside_batch() -> bool:
        return watcher.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted"
                               " AND pid <> pg_backend_pid()").fetchone()[0] > 0

    return inside_batch, lambda: (holder.rollback(), holder.close(), watcher.close())


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_sigkill_mid_batch_leaves_nothing_and_the_resent_batch_counts_once(
        request, tmp_path, backend):
    db = (str(tmp_path / "meter.db") if backend == "sqlite"
          else request.getfixturevalue("postgres_url"))
    meter = start_meter(tmp_path, db)
    try:
        inside_batch, release = (hold_meter_mid_batch_sqlite(db) if backend == "sqlite"
                                 else hold_meter_mid_batch_postgres(db))
        with grpc.insecure_channel(meter.target) as ch:
            call = meter_pb2_grpc.MeterServiceStub(ch).RecordUsage.future(batch(range(N)),
                                                                          timeout=120)
            wait_until(inside_batch)
            meter.kill()  # SIGKILL
            with pytest.raises(grpc.RpcError):
                call.result()
        release()
        meter.start()
        with grpc.insecure_channel(meter.target) as ch:
            stub = meter_pb2_grpc.MeterServiceStub(ch)
            assert stored(stub) == 0  # no partial batch
            r = stub.RecordUsage(batch(range(N)), timeout=60)  # the sender resends it
            assert (r.accepted, r.duplicates) == (N, 0)
            r = stub.RecordUsage(batch(range(N)), timeout=60)  # and once more: no effect
            assert (r.accepted, r.duplicates) == (0, N)
            assert stored(stub) == N
    finally:
        meter.kill()


def test_two_replicas_on_one_postgresql_count_concurrent_duplicates_once(tmp_path,
                                                                         postgres_url):
    a = start_meter(tmp_path, postgres_url, "meter-a")
    b = start_meter(tmp_path, postgres_url, "meter-b")
    try:
        with grpc.insecure_channel(a.target) as ca, grpc.insecure_channel(b.target) as cb:
            sa, sb = meter_pb2_grpc.MeterServiceStub(ca), meter_pb2_grpc.MeterServiceStub(cb)
            # Each event goes to both replicas at the same time, in overlapping batches
            # (A: ascending, B: descending ids).
            a_batches = [batch(range(i, i + 500)) for i in range(0, 2000, 500)]
            b_batches = [batch(range(i, i - 500, -1)) for i in range(1999, 0, -500)]
            with ThreadPoolExecutor(2) as pool:
                ra = pool.submit(lambda: [sa.RecordUsage(x, timeout=60) for x in a_batches])
                rb = pool.submit(lambda: [sb.RecordUsage(x, timeout=60) for x in b_batches])
                results = ra.result() + rb.result()
            assert sum(r.accepted for r in results) == 2000
            assert sum(r.duplicates for r in results) == 2000
            assert stored(sa) == stored(sb) == 2000
    finally:
        a.stop()
        b.stop()
