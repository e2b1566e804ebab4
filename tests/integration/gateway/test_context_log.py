"""The real gateway process logs a disagreement between etcd's max_context and an engine's
registered one as soon as it knows both: at start, and when an engine registers later."""
from __future__ import annotations

import json

from controlplane.schema import EngineRegistration
from tests.integration.gateway.conftest import start_gateway
from tests.integration.gateway.fakes import MODEL
from tests.integration.gateway.test_gateway_with_fakes import wait_for

# etcd's max_context for MODEL v1 (conftest's seed).
ETCD_CONTEXT = 64


def log_entries(log_path) -> list[dict]:
    entries = []
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def mismatches(log_path) -> list[dict]:
    return [{k: e.get(k) for k in ("level", "model", "version", "engine", "etcd_max_context",
                                   "engine_max_context", "using")}
            for e in log_entries(log_path) if e.get("event") == "engine_context_mismatch"]


def test_a_context_mismatch_is_logged_at_start_and_when_an_engine_registers(
        workdir, control, tokenizer, meter):
    # Registered before the gateway starts: the engine loaded a shorter model than etcd says.
    control.put(EngineRegistration("ctx-early", "127.0.0.1:1", MODEL, "v1", 8, max_context=48))
    gw = start_gateway(workdir, control.endpoint, tokenizer.target, meter.target, [],
                       name="gateway-ctx")
    log_path = gw.proc.log_path
    try:
        early = {"level": "warning", "model": MODEL, "version": "v1", "engine": "ctx-early",
                 "etcd_max_context": ETCD_CONTEXT, "engine_max_context": 48, "using": 48}
        assert mismatches(log_path) == [early]
        # At start: before the server serves (and before any config change, such as the
        # gateway's own registration, could have prompted it), with no request needed.
        events = [e.get("event") for e in log_entries(log_path)]
        assert events.index("engine_context_mismatch") < events.index("serving")

        control.put(EngineRegistration("ctx-late", "127.0.0.1:2", MODEL, "v1", 8,
                                       max_context=4096))
        found = wait_for(lambda: mismatches(log_path)[1:])
        assert found == [{**early, "engine": "ctx-late", "engine_max_context": 4096,
                          "using": ETCD_CONTEXT}]
    finally:
        assert gw.stop() == 0
