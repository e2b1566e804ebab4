"""The launcher's supervision loop over real processes (a real etcd and a real meter, killed
with SIGKILL): restarts with backoff, counted in up.json, then gives up on a crash loop."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from controlplane.launcher import Suite, SuitePorts
from controlplane.supervision import RestartPolicy


def wait_for(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.05)
    return None


def test_killed_processes_come_back_until_a_crash_loop_gives_up(tmp_path):
    said: list[str] = []
    suite = Suite(tmp_path, SuitePorts.ephemeral(), say=said.append)
    suite.start_etcd()
    suite.procs["meter"] = suite._process("meter").start(timeout=60)
    outcome: list[str] = []
    policy = RestartPolicy(initial_delay=0.2, max_crashes=3, window=60)
    supervisor = threading.Thread(target=lambda: outcome.append(suite.supervise(policy, 0.05)))
    supervisor.start()
    try:
        first = suite.procs["meter"].proc.pid
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: "meter is serving again" in said), said
        assert "meter exited with code -9; restart 1 in 0.2 s (restarts so far: {'meter': 1})" in said
        state = json.loads((tmp_path / "up.json").read_text())
        assert state["restarts"] == {"meter": 1}
        assert state["pids"]["meter"] == suite.procs["meter"].proc.pid != first

        os.kill(suite.etcd.process.pid, signal.SIGKILL)
        assert wait_for(lambda: "etcd is serving again" in said), said
        assert json.loads((tmp_path / "up.json").read_text())["restarts"] == {"meter": 1, "etcd": 1}

        # a process that dies as soon as it is back: the third crash in the window gives up
        for _ in range(2):
            pid = suite.procs["meter"].proc.pid
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: suite.procs["meter"].proc.pid != pid or outcome)
        supervisor.join(30)
        assert outcome == ["meter exited with code -9: 3 crashes within 60 s; giving up,"
                           f" stopping everything (see {tmp_path / 'logs' / 'meter.log'})"]
    finally:
        pids = [p.proc.pid for p in suite.procs.values()] + [suite.etcd.process.pid]
        suite.stop()
        supervisor.join(30)
    assert not supervisor.is_alive()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"{pid} still running"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
