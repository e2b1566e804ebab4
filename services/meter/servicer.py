"""MeterService adapter: protobuf in, ledger call (on the ledger's own thread), protobuf out."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Counter

from services.meter.export import csv_chunks
from services.meter.reconcile import reconcile
from services.meter.store import Ledger
from services.meter.usage import (DEFAULT_BUCKET_SECONDS, GroupBy, Source, UsageEvent,
                                  UsageQuery, check_batch_size)
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.runtime.errors import InvalidArgument

EVENTS_RECORDED = Counter("tokenserve_meter_events_recorded_total",
                          "Usage events stored for the first time", ["source"])
EVENTS_DUPLICATE = Counter("tokenserve_meter_duplicate_events_total",
                           "Usage events received again (same event_id) and not counted",
                           ["source"])

_SOURCES = {meter_pb2.SOURCE_GATEWAY: Source.GATEWAY, meter_pb2.SOURCE_ENGINE: Source.ENGINE}
_GROUPS = {
    meter_pb2.GROUP_BY_TENANT: GroupBy.TENANT, meter_pb2.GROUP_BY_APP: GroupBy.APP,
    meter_pb2.GROUP_BY_MODEL: GroupBy.MODEL, meter_pb2.GROUP_BY_VERSION: GroupBy.VERSION,
    meter_pb2.GROUP_BY_TIER: GroupBy.TIER, meter_pb2.GROUP_BY_TIME: GroupBy.TIME,
}


def event_from_pb(pb: meter_pb2.UsageEvent, where: str) -> UsageEvent:
    source = _SOURCES.get(pb.source)
    if source is None:
        raise InvalidArgument(
            f"{where}.source must be SOURCE_GATEWAY or SOURCE_ENGINE, got {pb.source}")
    return UsageEvent(
        event_id=pb.event_id, request_id=pb.request_id, source=source, tenant_id=pb.tenant_id,
        app=pb.app, model=pb.model, model_version=pb.model_version, tier=pb.tier,
        prompt_tokens=pb.prompt_tokens, completion_tokens=pb.completion_tokens,
        cached_tokens=pb.cached_tokens, status=pb.status, started_at=pb.started_at,
        finished_at=pb.finished_at, energy_joules=pb.energy_joules,
        energy_estimated=pb.energy_estimated, where=where)


def _bound(value: float) -> float | None:
    return value if value else None


def query_from_pb(pb: meter_pb2.QueryUsageRequest) -> UsageQuery:
    groups = []
    for i, g in enumerate(pb.group_by):
        if g not in _GROUPS:
            raise InvalidArgument(
                f"group_by[{i}] must be one of GROUP_BY_TENANT, GROUP_BY_APP, GROUP_BY_MODEL,"
                f" GROUP_BY_VERSION, GROUP_BY_TIER, GROUP_BY_TIME; got {g}")
        groups.append(_GROUPS[g])
    if pb.source == meter_pb2.SOURCE_UNSPECIFIED:
        source = Source.GATEWAY
    elif pb.source in _SOURCES:
        source = _SOURCES[pb.source]
    else:
        raise InvalidArgument(f"source must be SOURCE_GATEWAY or SOURCE_ENGINE, got {pb.source}")
    return UsageQuery(tenant_id=pb.tenant_id, start=_bound(pb.start), end=_bound(pb.end),
                      group_by=tuple(groups),
                      bucket_seconds=pb.bucket_seconds or DEFAULT_BUCKET_SECONDS,
                      source=source)


class MeterServicer(meter_pb2_grpc.MeterServiceServicer):
    def __init__(self, ledger: Ledger):
        self._ledger = ledger
        # One thread owns the ledger connection: calls are serialised and never block the loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self):
        await self._run(self._ledger.close)
        self._executor.shutdown(wait=True)

    async def RecordUsage(self, request, context):
        check_batch_size(len(request.events))
        events = [event_from_pb(e, f"events[{i}]") for i, e in enumerate(request.events)]
        result = await self._run(self._ledger.record, events)
        sent: dict[Source, int] = {}
        for e in events:
            sent[e.source] = sent.get(e.source, 0) + 1
        for source, n in sent.items():
            new = result.accepted_by_source.get(source, 0)
            EVENTS_RECORDED.labels(source.value).inc(new)
            EVENTS_DUPLICATE.labels(source.value).inc(n - new)
        return meter_pb2.RecordUsageResponse(accepted=result.accepted,
                                             duplicates=result.duplicates)

    async def QueryUsage(self, request, context):
        rows = await self._run(self._ledger.query, query_from_pb(request))
        return meter_pb2.QueryUsageResponse(rows=[
            meter_pb2.UsageRow(keys=list(r.keys), requests=r.requests,
                               prompt_tokens=r.prompt_tokens,
                               completion_tokens=r.completion_tokens,
                               cached_tokens=r.cached_tokens, energy_joules=r.energy_joules)
            for r in rows])

    async def Reconcile(self, request, context):
        q = UsageQuery(start=_bound(request.start), end=_bound(request.end))
        result = await self._run(reconcile, self._ledger, q.start, q.end)
        return meter_pb2.ReconcileResponse(matched=result.matched, mismatches=[
            meter_pb2.Mismatch(request_id=m.request_id, kind=m.kind,
                               gateway_value=m.gateway_value, engine_value=m.engine_value)
            for m in result.mismatches])

    async def ExportCsv(self, request, context):
        q = query_from_pb(request)
        # Materialised on the ledger thread; export is an admin operation over a time window.
        chunks = await self._run(lambda: list(csv_chunks(self._ledger.events(q))))
        for data in chunks:
            yield meter_pb2.CsvChunk(data=data)
