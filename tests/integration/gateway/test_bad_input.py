"""The bad-input table (tests/bad_input.py) through the real gateway process, over gRPC and
over HTTP, with FAKE tokenizer and engine (see conftest.py): every case gets its precise
status and a message naming what to fix, never INTERNAL or UNKNOWN."""
from __future__ import annotations

import grpc
import pytest

from controlplane.schema import Tenant
from tests.bad_input import CASES, cases, grpc_call, grpc_outcome, http_outcome, ids

TABLE = cases("fakes")


def test_the_table_covers_enough():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def authorizations(control, key):
    """Authorization values by the names the table uses."""
    revoked = control.issue_key("acme")
    control.revoke(revoked)
    control.put(Tenant("off", "Off Inc", "free", enabled=False))
    disabled = control.issue_key("off")
    return {"tenant": f"Bearer {key}", "none": None, "forged": "Bearer ts-" + "A" * 43,
            "empty": "Bearer ", "basic": "Basic dXNlcjpwYXNzd29yZA==",
            "openai": "Bearer sk-proj-0123456789abcdef", "revoked": f"Bearer {revoked}",
            "disabled": f"Bearer {disabled}"}


@pytest.fixture(scope="module")
def channel(gateway):
    with grpc.insecure_channel(gateway.target) as ch:
        yield ch


def settled(fn, timeout=10.0):
    """fn() once the gateway has seen the latest keys (config changes arrive within a second)."""
    import time
    end = time.monotonic() + timeout
    while True:
        got = fn()
        if time.monotonic() > end or got[0] not in ("OK", 200):
            return got
        time.sleep(0.1)


@pytest.mark.parametrize("case", [c for c in TABLE if c.scenario == "call"],
                         ids=ids([c for c in TABLE if c.scenario == "call"]))
def test_grpc_and_http_answer_precisely(case, channel, gateway, authorizations):
    auth = authorizations[case.key]
    wait = settled if case.key in ("revoked", "disabled") else (lambda fn: fn())
    code, details = wait(lambda: grpc_outcome(channel, case.request, auth))
    assert code == case.code, details
    for word in case.words:
        assert word in details, (word, details)

    status, error = wait(lambda: http_outcome(gateway.http_url, case.request, auth))
    assert status == case.http_status, error
    if status != 200:
        assert error.get("type") == case.http_type, error
        assert error.get("param") == case.http_param, error
        for word in case.expected_http_words:
            assert word in error.get("message", ""), (word, error)


@pytest.mark.parametrize("case", [c for c in TABLE if c.scenario == "reuse"],
                         ids=ids([c for c in TABLE if c.scenario == "reuse"]))
def test_a_request_id_in_flight_cannot_be_reused(case, channel, gateway, engine,
                                                 authorizations):
    auth = authorizations[case.key]
    engine.servicer.delay, delay = 0.3, engine.servicer.delay  # 16 tokens: about 5 s
    try:
        for second in ("grpc", "http"):
            first = grpc_call(channel, case.request, auth)
            assert next(first)  # admitted, and running (raw bytes of the first chunk)
            if second == "grpc":
                code, details = grpc_outcome(channel, case.request, auth)
                assert code == case.code and all(w in details for w in case.words), details
            else:
                status, error = http_outcome(gateway.http_url, case.request, auth)
                assert (status, error["type"]) == (case.http_status, case.http_type), error
                assert all(w in error["message"] for w in case.expected_http_words), error
            first.cancel()
    finally:
        engine.servicer.delay = delay
