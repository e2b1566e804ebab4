"""The client host of the multi-host test: runs inside its own network namespace and does what
the test asks, one JSON request per stdin line, one JSON answer per stdout line.

    {"op": "generate", "gateway": "10.213.0.11:50051", "key": "ts-...", "prompt": "...", ...}
    {"op": "tsctl", "args": ["--endpoints", "...", "status", "--json"]}
    {"op": "metric", "address": "10.213.0.11:9101", "name": "tokenserve_gateway_config_revision"}
    {"op": "health", "address": "10.213.0.21:50052", "timeout": 60}
    {"op": "etcd_health", "address": "10.213.0.1:2379", "timeout": 30}
    {"op": "prometheus_query", "address": "10.213.0.50:9090", "query": "up"}
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane import tsctl
from controlplane.top import parse_samples
from tokenserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def generate(req: dict) -> dict:
    """One streamed Generate; the status code name, the text and the chunks' token count."""
    with grpc.insecure_channel(req["gateway"]) as ch:
        stub = gateway_pb2_grpc.InferenceServiceStub(ch)
        text, tokens = [], 0
        try:
            for chunk in stub.Generate(
                    gateway_pb2.GenerateRequest(prompt=req["prompt"], max_tokens=req.get("max_tokens", 8)),
                    metadata=(("authorization", f"Bearer {req['key']}"),), timeout=req.get("timeout", 60)):
                text.append(chunk.text)
                tokens += len(chunk.token_ids)
        except grpc.RpcError as e:
            return {"code": e.code().name, "message": e.details(), "text": "".join(text), "tokens": tokens}
    return {"code": "OK", "message": "", "text": "".join(text), "tokens": tokens}


def failover(req: dict) -> dict:
    """What a client with two gateway addresses does: the first that answers serves it."""
    tried = []
    for gateway in req["gateways"]:
        out = generate({**req, "gateway": gateway})
        tried.append({"gateway": gateway, "code": out["code"]})
        if out["code"] == "OK" or out["tokens"]:  # retry only before the first token
            return {**out, "served_by": gateway, "tried": tried}
    return {**out, "served_by": None, "tried": tried}


def run_tsctl(req: dict) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = tsctl.main(req["args"])
    return {"rc": rc, "out": out.getvalue()}


def top_while_generating(req: dict) -> dict:
    """Runs `tsctl top` (req["args"]) while a long generation streams through a gateway."""
    first, stop = threading.Event(), threading.Event()

    def stream():
        with grpc.insecure_channel(req["gateway"]) as ch:
            call = gateway_pb2_grpc.InferenceServiceStub(ch).Generate(
                gateway_pb2.GenerateRequest(prompt=req["prompt"], max_tokens=req["max_tokens"]),
                metadata=(("authorization", f"Bearer {req['key']}"),), timeout=120)
            try:
                for _ in call:
                    first.set()
                    if stop.is_set():
                        call.cancel()
            except grpc.RpcError:
                pass  # cancelled once top is done (or failed: then still_streaming is False)
            first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    first.wait(60)
    try:
        out = run_tsctl(req)
        return {**out, "still_streaming": thread.is_alive()}
    finally:
        stop.set()
        thread.join(60)


def metric(req: dict) -> dict:
    try:
        with urllib.request.urlopen(f"http://{req['address']}/metrics", timeout=2) as r:
            samples = parse_samples(r.read().decode())
    except OSError as e:
        return {"value": None, "error": str(e)}
    values = [v for (name, _), v in samples.items() if name == req["name"]]
    return {"value": sum(values) if values else None, "error": None}


def prometheus_query(req: dict) -> dict:
    """An instant query against Prometheus' HTTP API: the result vector."""
    url = f"http://{req['address']}/api/v1/query?" + urllib.parse.urlencode({"query": req["query"]})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except OSError as e:
        return {"result": None, "error": str(e)}
    return {"result": body["data"]["result"], "error": None}


def health(req: dict) -> dict:
    deadline = time.monotonic() + req.get("timeout", 60)
    status = "UNKNOWN"
    while time.monotonic() < deadline:
        with grpc.insecure_channel(req["address"]) as ch:
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                status = e.code().name
        if status == "SERVING":
            break
        time.sleep(0.2)
    return {"status": status}


def etcd_health(req: dict) -> dict:
    deadline = time.monotonic() + req.get("timeout", 30)
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{req['address']}/health", timeout=1) as r:
                if b'"health":"true"' in r.read():
                    return {"healthy": True}
        except OSError:
            pass
        time.sleep(0.2)
    return {"healthy": False}


OPS = {"generate": generate, "failover": failover, "tsctl": run_tsctl, "metric": metric,
       "top_while_generating": top_while_generating, "prometheus_query": prometheus_query,
       "health": health, "etcd_health": etcd_health}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            answer = OPS[req["op"]](req)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            answer = {"exception": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
