"""Failing engine replicas leave routing and come back: the real gateway process with a real
etcd and meter, and two FAKE engine replicas of one version (fakes.py), one made to fail."""
from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from tests.integration.gateway.conftest import start_gateway
from tests.integration.gateway.fakes import fake_engine
from tokenserve.gateway.v1 import gateway_pb2 as pb


def auth(key):
    return (("authorization", f"Bearer {key}"),)


def metric(gateway, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


@pytest.fixture
def replicas():
    servers = [fake_engine(), fake_engine()]
    # Sequential requests find both idle, and ties go to the endpoint that sorts first: make
    # that one the replica that fails, so it is the one that would get the traffic.
    servers.sort(key=lambda s: s.target)
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def two_replica_gateway(workdir, control, key, tokenizer, meter, replicas):
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target,
                       [r.target for r in replicas], name="gateway-health",
                       extra_args=["--eject-after", "2", "--eject-backoff", "0.3",
                                   "--eject-backoff-max", "0.6"])
    yield gw
    gw.stop()


def generate(stub, key, rid):
    req = pb.GenerateRequest(prompt="a b c", max_tokens=2, request_id=rid)
    return list(stub.Generate(req, metadata=auth(key), timeout=10))


def test_a_failing_replica_is_ejected_probed_and_readmitted(two_replica_gateway, key, replicas):
    stub = two_replica_gateway.stub()
    failing, healthy = replicas
    for i in range(3):
        generate(stub, key, f"warm-{i}")
    assert len(failing.servicer.requests) == 3 and not healthy.servicer.requests

    failing.servicer.fail_with = grpc.StatusCode.UNAVAILABLE
    failing.set_serving(False)
    before = len(failing.servicer.requests)
    for i in range(20):  # callers see no failure: each refusal is retried on the other replica
        assert generate(stub, key, f"out-{i}")[-1].model_version == "v1"
        time.sleep(0.05)
    # Two refusals took it out; its probes (1 s of backoffs) said NOT_SERVING: no more calls.
    assert len(failing.servicer.requests) - before == 2
    assert len(healthy.servicer.requests) == 20
    assert metric(two_replica_gateway, "tokenserve_gateway_engines_ejected") == 1
    assert metric(two_replica_gateway, "tokenserve_gateway_engine_ejections_total") >= 2

    failing.servicer.fail_with = None
    failing.set_serving(True)
    served = len(failing.servicer.requests)
    deadline = time.monotonic() + 5
    while len(failing.servicer.requests) == served and time.monotonic() < deadline:
        generate(stub, key, f"back-{time.monotonic()}")
        time.sleep(0.05)
    assert len(failing.servicer.requests) > served, "the recovered replica got no traffic"
    n = len(failing.servicer.requests)
    for i in range(5):
        generate(stub, key, f"after-{i}")
    assert len(failing.servicer.requests) == n + 5  # back in routing, first choice again
    assert metric(two_replica_gateway, "tokenserve_gateway_engines_ejected") == 0
