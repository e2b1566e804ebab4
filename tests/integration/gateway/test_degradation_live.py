"""The degradation ladder as operators and callers meet it: `tsctl degrade set` / `tsctl power
set` (subprocesses) against a real etcd, the real gateway process (and meter), and a FAKE
engine whose WatchLoad stream reports the load the test sets (fakes.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from controlplane.schema import Tenant, Tier
from controlplane.top import parse_samples
from tests.integration.gateway.conftest import start_gateway
from tests.integration.gateway.fakes import MODEL, fake_engine
from tests.integration.gateway.test_admission_gateway import generate
from tests.integration.gateway.test_gateway_with_fakes import meter_rows, wait_for
from tokenserve.engine.v1 import engine_pb2

HOLD = 1.5


def tsctl(control, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "controlplane.tsctl", "--endpoints",
                        control.endpoint, "--actor", "oncall", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def report(waiting: int = 0, watts: float = 5.0) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(model=MODEL, version="v1", waiting=waiting, running=1,
                                 kv_blocks_used=10, kv_blocks_total=100, ttft_p99_seconds=0.2,
                                 watts=watts, watts_estimated=True)


@pytest.fixture(scope="module")
def loaded_engine():
    server = fake_engine(delay=0.01, load=report(waiting=8))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keys(control):
    control.put(Tier("standard", 50, 100_000, 5_000_000, 16, 1, 32), Tenant("std", "Std", "standard"))
    return {"free": control.issue_key("acme"), "standard": control.issue_key("std"),
            "premium": control.issue_key("vip")}


@pytest.fixture(scope="module")
def gw(workdir, control, keys, tokenizer, loaded_engine, meter):
    # the policy an operator writes: every threshold, the ladder, a short hold for the test
    tsctl(control, "degrade", "set", "--queue-depth", "100", "--ttft-p99", "2", "--kv-use", "0.95",
          "--power-vs-budget", "1", "--ladder", "free=cap_max_tokens,reject",
          "--ladder", "standard=queue,queue,reject", "--ladder", "premium=queue",
          "--cap-max-tokens", "3", "--margin", "0.1", "--hold-seconds", str(HOLD))
    g = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                      [loaded_engine.target], name="gateway-degrade")
    yield g
    g.stop()


def level_metric(gw) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5) as r:
        samples = parse_samples(r.read().decode())
    return samples.get(("tokenserve_gateway_degradation_level", ()))


def until_level(gw, level: int, timeout: float = 10.0) -> float:
    """Seconds until the gauge shows `level`."""
    t0 = time.monotonic()
    assert wait_for(lambda: level_metric(gw) == level, timeout), f"level stayed {level_metric(gw)}"
    return time.monotonic() - t0


def test_levels_follow_live_thresholds_and_fall_back_after_the_hold(
        gw, control, keys, loaded_engine, meter_stub):
    stub = gw.stub()
    code, _, chunks, md = generate(stub, keys["free"], max_tokens=10)
    assert code == "OK" and md["x-degradation-level"] == "0"
    assert sum(len(c.token_ids) for c in chunks) == 10

    # level 1 (8 waiting vs 7: 1.14x): free requests are capped to 3 tokens, others untouched
    tsctl(control, "degrade", "set", "--queue-depth", "7")
    assert until_level(gw, 1) < 1.5
    code, _, chunks, md = generate(stub, keys["free"], max_tokens=10)
    assert code == "OK" and sum(len(c.token_ids) for c in chunks) == 3
    assert (md["x-degradation-level"], md["x-degradation-max-tokens"]) == ("1", "3")
    code, _, chunks, md = generate(stub, keys["standard"], max_tokens=10)
    assert code == "OK" and sum(len(c.token_ids) for c in chunks) == 10
    assert "x-degradation-max-tokens" not in md

    # level 2 (1.6x): free is shed, with the reason and a retry-after; premium is served
    tsctl(control, "degrade", "set", "--queue-depth", "5")
    assert until_level(gw, 2) < 1.5
    seen = len(loaded_engine.servicer.requests)
    code, details, _, trailing = generate(stub, keys["free"], request_id="shed-1")
    assert code == "RESOURCE_EXHAUSTED" and details.startswith("degraded: level 2, free tier shed")
    assert trailing["limit"] == "degraded" and trailing["x-degradation-level"] == "2"
    assert 1000 <= int(trailing["retry-after-ms"]) <= HOLD * 1000
    assert len(loaded_engine.servicer.requests) == seen  # no engine work ...
    for tier in ("standard", "premium"):
        code, _, _, md = generate(stub, keys[tier], max_tokens=4)
        assert code == "OK" and md["x-degradation-level"] == "2"
    status = wait_for(lambda: _gateway_line(tsctl(control, "status"), gw), 5)
    assert status and status.split()[2:4] == ["2", "queue_depth"]  # ID ENDPOINT LEVEL REASON
    assert meter_rows(meter_stub, "shed-1") == []  # ... and nothing billed

    # the HTTP front says the same
    req = urllib.request.Request(
        f"{gw.http_url}/completions", data=json.dumps({"prompt": "a b", "max_tokens": 2}).encode(),
        headers={"authorization": f"Bearer {keys['free']}", "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 429 and err.value.headers["x-degradation-level"] == "2"
    assert "degraded: level 2, free tier shed" in json.loads(err.value.read())["error"]["message"]

    # power: the queue threshold raised, a budget below the engine's draw (25 W vs 10 W: 2.5x)
    tsctl(control, "degrade", "set", "--queue-depth", "100")
    loaded_engine.servicer.load = report(waiting=8, watts=25.0)
    tsctl(control, "power", "set", "10")
    assert until_level(gw, 3) < 1.5
    code, details, _, _ = generate(stub, keys["standard"])
    assert code == "RESOURCE_EXHAUSTED" and "level 3, standard tier shed" in details
    assert generate(stub, keys["premium"], max_tokens=4)[0] == "OK"
    top = json.loads(tsctl(control, "--json", "top", "--once", "--interval", "0.5",
                           "--metrics", f"127.0.0.1:{gw.metrics_port}"))
    assert top["gateways"][0]["degradation_level"] == 3

    # the draw falls: the level is held for the hold time, then drops to 0
    loaded_engine.servicer.load = report(waiting=0, watts=1.0)
    assert wait_for(lambda: _ratios(gw).get("power_watts_vs_budget", 9) < 0.5, 5)
    calm = time.monotonic()
    assert level_metric(gw) == 3
    until_level(gw, 0, timeout=HOLD + 5)
    assert time.monotonic() - calm >= HOLD - 0.3
    code, _, chunks, md = generate(stub, keys["free"], max_tokens=10)
    assert code == "OK" and md["x-degradation-level"] == "0"


def _gateway_line(status: str, gw) -> str | None:
    """The gateway's row of `tsctl status` once it shows level 2."""
    rows = [ln for ln in status.splitlines() if gw.target in ln]
    return rows[0] if rows and rows[0].split()[2] == "2" else None


def _ratios(gw) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5) as r:
        samples = parse_samples(r.read().decode())
    return {dict(labels)["signal"]: v for (n, labels), v in samples.items()
            if n == "tokenserve_gateway_degradation_signal_ratio"}


def test_degrade_show_explains_the_levels(gw, control):
    out = tsctl(control, "degrade", "show")
    assert "levels:" in out and "1 at 1x: free cap_max_tokens 3, standard queue, premium queue" in out
    assert "3 at 2x: free reject, standard reject, premium queue" in out
    assert "below 0.9 x its threshold for 1.5 s" in out
