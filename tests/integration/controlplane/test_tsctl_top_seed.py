"""`tsctl seed` and `tsctl top`'s live mode, as an operator runs them: subprocesses against a
real etcd. (`top --once --json` against engines and gateways: tests/integration/multihost.)"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from controlplane.seed import default_documents

pytestmark = pytest.mark.slow  # tsctl as subprocesses, like test_tsctl.py


def tsctl(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.tsctl", "--endpoints", endpoint,
                           "--actor", "tester", *args], capture_output=True, text=True, timeout=60)


def test_seed_writes_the_defaults_once_and_keeps_an_operators_edit(etcd):
    first = tsctl(etcd.endpoint, "seed", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["written"] == [d.key for d in default_documents()]
    assert tsctl(etcd.endpoint, "tier", "set", "free", "--rps", "3").returncode == 0
    again = tsctl(etcd.endpoint, "seed")
    assert again.returncode == 0 and again.stdout.strip() == "seeded: nothing (all present)"
    shown = json.loads(tsctl(etcd.endpoint, "tier", "show", "--json").stdout)
    assert next(t for t in shown if t["name"] == "free")["requests_per_second"] == 3


def test_top_redraws_every_interval_until_interrupted(etcd, port):
    # SIGINT as a terminal gives it: a test run started in the background of a shell without
    # job control inherits SIGINT ignored, and Python then never turns it into Ctrl-C
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.tsctl", "--endpoints", etcd.endpoint,
                             "top", "--interval", "0.2", "--metrics", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    frames, out = 0, []
    try:
        for line in proc.stdout:
            out.append(line)
            frames += line.startswith("\x1b[2J\x1b[H")
            if frames == 3:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
    text = "".join(out)
    assert frames == 3, text + proc.stderr.read()
    assert rc == 130
    assert "ENGINES" in text and "GATEWAYS" in text
    assert f"unreachable: 127.0.0.1:{port}" in text  # nothing serves /metrics there
