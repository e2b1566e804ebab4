"""Usage events as text, in chunks of whole lines: CSV (header first) or CloudEvents 1.0
JSON lines (the format OpenMeter and other billing pipelines ingest)."""
from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone
from typing import Iterable, Iterator

from tokenserve.usage import FIELDS, UsageRecord, to_row

LINES_PER_CHUNK = 500
CLOUDEVENT_TYPE = "dev.tokenserve.usage.v1"
CLOUDEVENT_SOURCE = "tokenserve/meter"


def _chunks(lines: Iterable[str]) -> Iterator[str]:
    buf: list[str] = []
    for line in lines:
        buf.append(line)
        if len(buf) >= LINES_PER_CHUNK:
            yield "".join(buf)
            buf.clear()
    if buf:
        yield "".join(buf)


def _csv_line(values) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()


def csv_chunks(events: Iterable[UsageRecord]) -> Iterator[str]:
    """Columns are the usage fields; source as its name, flags as 0/1."""
    def lines() -> Iterator[str]:
        yield _csv_line(FIELDS)
        for e in events:
            yield _csv_line(to_row(e))

    yield from _chunks(lines())


def cloudevent(e: UsageRecord) -> dict:
    """One CloudEvent: the event id is the CloudEvent id (consumers dedupe on source + id),
    the tenant is the subject, the finish time is the event time."""
    data = {name: value for name, value in zip(FIELDS, to_row(e))
            if name not in ("event_id", "tenant_id")}
    for name in ("preempted", "cancelled", "energy_estimated"):
        data[name] = bool(data[name])
    return {
        "specversion": "1.0",
        "type": CLOUDEVENT_TYPE,
        "id": e.event_id,
        "source": f"{CLOUDEVENT_SOURCE}/{e.source.value}",
        "subject": e.tenant_id,
        "time": datetime.fromtimestamp(e.finished_at, timezone.utc).isoformat().replace(
            "+00:00", "Z"),
        "datacontenttype": "application/json",
        "data": data,
    }


def cloudevents_chunks(events: Iterable[UsageRecord]) -> Iterator[str]:
    yield from _chunks(json.dumps(cloudevent(e), separators=(",", ":")) + "\n" for e in events)
