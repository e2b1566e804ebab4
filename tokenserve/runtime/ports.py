"""Free TCP ports for processes started on this machine (tests, `tokenserve up --ephemeral-ports`).

The port comes from below the kernel's ephemeral range: a port from bind(0) is one the kernel
also hands to outgoing connections, so between choosing it and the service binding it (the
gateway binds last, tens of seconds into a suite's start) any client socket could take it.
Successive calls in a process walk the range from a random start, so they never repeat a port
(until ~12,000 calls) even before the first one is bound.
"""
from __future__ import annotations

import itertools
import random
import socket
from pathlib import Path

_SPAN = 12_000  # ports used below the ephemeral range


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_TOP = _ephemeral_start()
_LOW = max(1024, _TOP - _SPAN)
_walk = itertools.count(random.randrange(max(1, _TOP - _LOW)))  # next() is atomic under the GIL


def free_port() -> int:
    """A port nobody listens on now, that the kernel does not give to outgoing connections and
    that no earlier call in this process returned (where the ephemeral range leaves room below
    it; otherwise one the kernel picks)."""
    for _ in range(_TOP - _LOW):
        port = _LOW + next(_walk) % (_TOP - _LOW)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
