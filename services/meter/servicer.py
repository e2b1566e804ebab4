"""MeterService adapter: protobuf in, ledger call (on the ledger's own thread), protobuf out."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Counter

from services.meter import drift
from services.meter.export import cloudevents_chunks, csv_chunks
from services.meter.reconcile import reconcile
from services.meter.store import Ledger
from services.meter.usage import (DEFAULT_BUCKET_SECONDS, GroupBy, IngestRules, UsageQuery,
                                  UsageRow)
from tokenserve.meter.v1 import meter_pb2, meter_pb2_grpc
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.usage import Source, UsageRecord, from_pb, source_from_pb

EVENTS_RECORDED = Counter("tokenserve_meter_events_recorded_total",
                          "Usage events stored for the first time", ["source"])
EVENTS_DUPLICATE = Counter("tokenserve_meter_duplicate_events_total",
                           "Usage events received again (same event_id) and not counted",
                           ["source"])

_GROUPS = {
    meter_pb2.GROUP_BY_TENANT: GroupBy.TENANT, meter_pb2.GROUP_BY_APP: GroupBy.APP,
    meter_pb2.GROUP_BY_MODEL: GroupBy.MODEL, meter_pb2.GROUP_BY_VERSION: GroupBy.VERSION,
    meter_pb2.GROUP_BY_TIER: GroupBy.TIER, meter_pb2.GROUP_BY_TIME: GroupBy.TIME,
}


def events_from_pb(pbs) -> list[UsageRecord]:
    out = []
    for i, pb in enumerate(pbs):
        try:
            out.append(from_pb(pb))
        except ValueError as e:
            raise InvalidArgument(f"events[{i}].{e}") from None
    return out


def row_to_pb(r: UsageRow) -> meter_pb2.UsageRow:
    return meter_pb2.UsageRow(
        keys=list(r.keys), requests=r.requests, prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens, cached_tokens=r.cached_tokens,
        energy_joules=r.energy_joules, total_tokens=r.total_tokens,
        tokens_per_joule=r.tokens_per_joule, energy_estimated=r.energy_estimated)


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
    elif (source := source_from_pb(pb.source)) is None:
        raise InvalidArgument(f"source must be SOURCE_GATEWAY or SOURCE_ENGINE, got {pb.source}")
    return UsageQuery(tenant_id=pb.tenant_id, start=_bound(pb.start), end=_bound(pb.end),
                      group_by=tuple(groups),
                      bucket_seconds=pb.bucket_seconds or DEFAULT_BUCKET_SECONDS,
                      source=source)


class MeterServicer(meter_pb2_grpc.MeterServiceServicer):
    def __init__(self, ledger: Ledger, rules: IngestRules | None = None):
        self._ledger = ledger
        self._rules = rules or IngestRules()
        # One thread owns the ledger connection: calls are serialised and never block the loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self):
        await self._run(self._ledger.close)
        self._executor.shutdown(wait=True)

    async def RecordUsage(self, request, context):
        events = events_from_pb(request.events)
        self._rules.check_batch(events)  # all or nothing: one bad event refuses the batch
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
        return meter_pb2.QueryUsageResponse(rows=[row_to_pb(r) for r in rows])

    async def Reconcile(self, request, context):
        q = UsageQuery(start=_bound(request.start), end=_bound(request.end))
        records = await self._run(self._ledger.requests_finished_in, q)
        result = reconcile(records)
        drift.publish(result, time.time())
        return meter_pb2.ReconcileResponse(matched=result.matched, mismatches=[
            meter_pb2.Mismatch(request_id=m.request_id, kind=m.kind, field=m.field,
                               gateway_value=m.gateway_value, engine_value=m.engine_value)
            for m in result.mismatches])

    async def _export(self, request, render):
        q = query_from_pb(request)
        # Materialised on the ledger thread; export is an admin operation over a time window.
        chunks = await self._run(lambda: list(render(self._ledger.events(q))))
        for data in chunks:
            yield meter_pb2.ExportChunk(data=data)

    async def ExportCsv(self, request, context):
        async for chunk in self._export(request, csv_chunks):
            yield chunk

    async def ExportCloudEvents(self, request, context):
        async for chunk in self._export(request, cloudevents_chunks):
            yield chunk
