"""Stop strings matched on text, across token boundaries.

    stop = StopMatcher(["\\n\\n", "</answer>"])
    safe, hit = stop.push(delta)     # safe never contains (part of) a stop string it matched
    if hit: finish(reason="stop")
    else at the end: safe += stop.flush()

Holds back only the longest tail of the text seen so far that could still be the start of a
stop string; everything before it is released at once.
"""
from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stop_strings: Iterable[str]):
        self.stops = tuple(s for s in dict.fromkeys(stop_strings) if s)
        self._held = ""
        self.stopped = False
        # Which stop string matched, once stopped (for usage/finish details).
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Adds a text delta; returns (text safe to emit, whether a stop string matched).

        After a match the returned text ends right before the stop string and further pushes
        return ('', True)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hit, where = None, len(buf)
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and i < where:
                hit, where = s, i
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit, ""
            return buf[:where], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """Generation ended for another reason: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
