"""Usage events as CSV text, header first, in chunks of whole lines."""
from __future__ import annotations

import csv
import io
from typing import Iterable, Iterator

from services.meter.store import COLUMNS
from services.meter.usage import UsageEvent

LINES_PER_CHUNK = 500


def csv_chunks(events: Iterable[UsageEvent]) -> Iterator[str]:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    lines = 1
    for e in events:
        row = [getattr(e, c) for c in COLUMNS]
        row[COLUMNS.index("source")] = e.source.value
        row[COLUMNS.index("energy_estimated")] = int(e.energy_estimated)
        writer.writerow(row)
        lines += 1
        if lines >= LINES_PER_CHUNK:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
            lines = 0
    if buf.tell():
        yield buf.getvalue()
