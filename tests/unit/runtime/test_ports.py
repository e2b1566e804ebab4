"""free_port: ports a starting suite can reserve without an outgoing connection taking them."""
from __future__ import annotations

import socket
from pathlib import Path

from tokenserve.runtime import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(1024 <= p < start for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_in_use_is_skipped():
    def after(port: int) -> int:  # the port the walk comes to next
        return ports._LOW + (port + 1 - ports._LOW) % (ports._TOP - ports._LOW)

    taken = after(ports.free_port())
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert ports.free_port() == after(taken)
