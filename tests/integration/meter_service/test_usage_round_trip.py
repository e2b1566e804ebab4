"""Every usage field, from the record the gateway builds (and the one the engine builds) to
the row the meter stores: through the real spool file, the shared sender, gRPC to a real
meter process, the meter's conversion and its SQL table, read back from the database."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc

from services.engine.engine_core import FinalStats, RequestOutput
from services.engine.sequence import FinishReason
from services.engine.usage import EngineUsage
from services.gateway.admission import Limits
from services.gateway.auth import Caller
from services.gateway.inference import _Progress
from services.gateway.validation import InferenceRequest
from services.meter.store import Ledger
from services.meter.usage import UsageQuery
from tokenserve.runtime.ports import free_port
from controlplane.service_process import ServiceProcess
from tokenserve.meter.v1 import meter_pb2_grpc
from tokenserve.spool import SpoolSender, UsageSpool, send_usage
from tokenserve.usage import FIELDS, Source, UsageRecord


def gateway_record() -> UsageRecord:
    caller = Caller(tenant_id="acme", tier="premium", priority=2, max_tokens=64,
                    key_prefix="ts-abc", limits=Limits("premium", 200, 400_000, 10**7, 64))
    req = InferenceRequest(model="smollm2", max_tokens=8, prompt="never stored",
                           request_id="req-rt", app="bot")
    progress = _Progress(caller, req, "smollm2", prompt_tokens=12)
    progress.version, progress.completion_tokens, progress.cached_tokens = "q4_1", 7, 4
    progress.energy_joules, progress.energy_estimated = 0.625, True
    progress.finish_reason = "stop"
    return progress.record("OK")


def engine_record(tmp_path) -> UsageRecord:
    spool = UsageSpool(tmp_path / "scratch.db")
    seq = SimpleNamespace(request_id="req-rt", tenant_id="acme")
    final = FinalStats(prompt_tokens=12, completion_tokens=9, cached_tokens=4,
                       queue_seconds=0.1, time_to_first_token_seconds=0.2, total_seconds=1.5,
                       energy_joules=0.75, energy_estimated=True, num_preemptions=1)
    out = RequestOutput(1, "req-rt", finish_reason=FinishReason.CANCELLED, final=final)
    rec = EngineUsage("smollm2", "q4_1", spool).record(seq, out)
    spool.close()
    return rec


def start_meter(tmp_path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess("services.meter", ["--port", str(port), "--metrics-port", "-1",
                                             "--db", str(tmp_path / "meter.db")],
                          port, log_path=tmp_path / "meter.log").start()


def test_every_field_reaches_the_stored_row_unchanged(tmp_path):
    records = [gateway_record(), engine_record(tmp_path)]
    # Between them the two records set every field off its default, so none can be dropped
    # or swapped on the way without this test seeing it.
    blank = UsageRecord(event_id="", request_id="", source=Source.GATEWAY, tenant_id="")
    covered = {n for r in records for n in FIELDS if getattr(r, n) != getattr(blank, n)}
    assert covered == set(FIELDS)

    db = tmp_path / "meter.db"
    meter = start_meter(tmp_path)
    try:
        async def ship():
            spool = UsageSpool(tmp_path / "spool.db")
            for r in records:
                spool.append(r)
            async with grpc.aio.insecure_channel(meter.target) as ch:
                stub = meter_pb2_grpc.MeterServiceStub(ch)
                sender = SpoolSender(spool, lambda batch: send_usage(stub, batch, 10.0))
                sent = await sender.send_pending()
            left = len(spool)
            spool.close()
            return sent, left

        assert asyncio.run(ship()) == (2, 0)
    finally:
        meter.stop()
    ledger = Ledger.open(str(db))
    stored = sorted(ledger.events(UsageQuery(), all_sources=True), key=lambda r: r.source.value)
    ledger.close()
    assert stored == sorted(records, key=lambda r: r.source.value)
    for want, got in zip(sorted(records, key=lambda r: r.source.value), stored):
        assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_a_record_the_meter_refuses_for_good_is_set_aside_and_the_rest_is_sent(tmp_path):
    good = gateway_record()
    stale = dataclasses.replace(good, event_id="stale", started_at=1.0, finished_at=2.0)
    later = dataclasses.replace(good, event_id="later")
    meter = start_meter(tmp_path)
    try:
        async def ship():
            spool = UsageSpool(tmp_path / "spool.db")
            for r in (good, stale, later):
                spool.append(r)
            async with grpc.aio.insecure_channel(meter.target) as ch:
                stub = meter_pb2_grpc.MeterServiceStub(ch)
                await SpoolSender(spool, lambda b: send_usage(stub, b, 10.0)).send_pending()
            left, refused = len(spool), spool.refused()
            spool.close()
            return left, refused

        left, refused = asyncio.run(ship())
    finally:
        meter.stop()
    assert left == 0
    assert [(r.event_id, "outside the accepted window" in why) for r, why in refused] == [
        ("stale", True)]
    ledger = Ledger.open(str(tmp_path / "meter.db"))
    assert sorted(e.event_id for e in ledger.events(UsageQuery())) == [good.event_id, "later"]
    ledger.close()
