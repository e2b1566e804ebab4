"""Network namespaces as hosts on one machine: each host gets its own namespace with one
veth link (eth0, 10.213.0.N/24) into a bridge that lives in a switch namespace, so no address
or route is added outside the namespaces made here.

    net = Network("ts1234")
    net.start()
    net.add_host("etcd1", "10.213.0.1")
    proc = net.spawn("etcd1", ["etcd", ...], log=path)
    net.cut("gw1"); net.heal("gw1")               # the host's link down / up
    net.partition("gw1", "etcd1"); net.rejoin(...)  # two hosts cannot reach each other
    net.close()                                   # kills what it spawned, deletes namespaces
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

SUBNET_PREFIX = 24


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def netns_permitted() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    name = f"tsprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` is not permitted here: {e.stderr.strip()}"
    ip("netns", "del", name)
    return None


class Network:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.hosts: dict[str, str] = {}  # host -> address
        self.procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []

    def start(self) -> None:
        """Makes the switch; call inside the try whose finally calls close()."""
        self._namespaces.append(self.switch)
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "dev", "br0", "up")

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _port(self, host: str) -> str:
        return f"p-{host}"[:15]  # the host's link, switch side

    def add_host(self, host: str, address: str) -> None:
        ns = self.ns(host)
        self._namespaces.append(ns)
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "dev", "lo", "up")
        ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self._port(host),
           "netns", self.switch)
        ip("-n", self.switch, "link", "set", "dev", self._port(host), "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{address}/{SUBNET_PREFIX}", "dev", "eth0")
        ip("-n", ns, "link", "set", "dev", "eth0", "up")
        self.hosts[host] = address

    def spawn(self, host: str, argv: list[str], *, log: Path, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv],
                                stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def cut(self, host: str) -> None:
        """The host's cable pulled: nothing reaches it, nothing leaves it."""
        ip("-n", self.switch, "link", "set", "dev", self._port(host), "down")

    def heal(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", "dev", self._port(host), "up")

    def partition(self, a: str, b: str) -> None:
        """Hosts a and b can no longer reach each other (both directions: a route only on
        one side still lets data the other side pushes arrive); the rest of the net is intact."""
        ip("-n", self.ns(a), "route", "add", "unreachable", f"{self.hosts[b]}/32")
        ip("-n", self.ns(b), "route", "add", "unreachable", f"{self.hosts[a]}/32")

    def rejoin(self, a: str, b: str) -> None:
        ip("-n", self.ns(a), "route", "del", "unreachable", f"{self.hosts[b]}/32")
        ip("-n", self.ns(b), "route", "del", "unreachable", f"{self.hosts[a]}/32")

    @staticmethod
    def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> int | None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def close(self) -> None:
        """Kills every process spawned (each by its own handle), then deletes the namespaces."""
        for proc in reversed(self.procs):
            self.stop(proc, signal.SIGKILL)
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._namespaces.clear()
