"""tokenserve across hosts: every host a network namespace on this machine (veth links into one
bridge), every service a real process, the real SmolLM2 model in the engine.

    etcd1 10.213.0.1   etcd2 10.213.0.2   etcd3 10.213.0.3     (one three-member cluster)
    gw1   10.213.0.11  gw2   10.213.0.12                       (gateways, no static engines)
    tok   10.213.0.21  eng   10.213.0.31  meter 10.213.0.41
    mon   10.213.0.50  (Prometheus, where the Debian package is installed)
    client 10.213.0.100                                        (tsctl and the API calls)

The tests share one cluster and run in file order; each leaves it as the next expects.
Skipped, with the reason, where network namespaces cannot be made (failed instead with CI=true).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.etcd_local import find_etcd_binary
from tests.integration.multihost.netns import Network, netns_permitted
from tokenserve.models import DEFAULT_MODEL_NAME, default_model_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
HOSTS = {"etcd1": "10.213.0.1", "etcd2": "10.213.0.2", "etcd3": "10.213.0.3",
         "gw1": "10.213.0.11", "gw2": "10.213.0.12", "tok": "10.213.0.21", "eng": "10.213.0.31",
         "meter": "10.213.0.41", "mon": "10.213.0.50", "client": "10.213.0.100"}
METRICS = {"gw1": 9101, "gw2": 9101, "tok": 9102, "eng": 9103, "meter": 9104}
ETCD = ("etcd1", "etcd2", "etcd3")
ENDPOINTS = ",".join(f"{HOSTS[h]}:2379" for h in ETCD)
GW1, GW2 = f"{HOSTS['gw1']}:50051", f"{HOSTS['gw2']}:50051"
PROMPT = "The capital of France is"


class Client:
    """The helper process on the client host (tests/integration/multihost/client_host.py)."""

    def __init__(self, net: Network, env: dict, log: Path):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", net.ns("client"), sys.executable, "-m",
             "tests.integration.multihost.client_host"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("ab"), text=True,
            env=env, cwd=ROOT, start_new_session=True)
        net.procs.append(self.proc)

    def call(self, op: str, **req) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **req}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"client host exited (code {self.proc.poll()})"
        answer = json.loads(line)
        assert "exception" not in answer, answer["exception"]
        return answer

    def tsctl(self, *args: str) -> str:
        out = self.call("tsctl", args=["--endpoints", ENDPOINTS, "--actor", "multihost", *args])
        assert out["rc"] == 0, out
        return out["out"]

    def generate(self, gateway: str, key: str, **kw) -> dict:
        return self.call("generate", gateway=gateway, key=key, prompt=PROMPT, **kw)

    def metric(self, host: str, port: int, name: str) -> float | None:
        return self.call("metric", address=f"{HOSTS[host]}:{port}", name=name)["value"]

    def wait_status(self, predicate, timeout: float = 30.0) -> dict:
        """Polls `tsctl status --json` until predicate(status) holds (bounded); the last status."""
        end = time.monotonic() + timeout
        while True:
            status = json.loads(self.tsctl("status", "--json"))
            if predicate(status) or time.monotonic() > end:
                return status
            time.sleep(0.25)

    def wait_metric(self, host: str, port: int, name: str, predicate, timeout: float = 30.0):
        """Polls a gauge on a host's /metrics until predicate(value) holds (bounded)."""
        end, value = time.monotonic() + timeout, None
        while time.monotonic() < end:
            value = self.metric(host, port, name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.25)
        return value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = netns_permitted()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"multi-host test needs network namespaces: {reason}")
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    tmp = tmp_path_factory.mktemp("multihost")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    net = Network(f"ts{os.getpid() % 100000}")
    try:
        net.start()
        for host, address in HOSTS.items():
            net.add_host(host, address)
        procs = start(net, tmp, env)
        client = Client(net, env, tmp / "client.log")
        for h in ETCD:
            assert client.call("etcd_health", address=f"{HOSTS[h]}:2379", timeout=30)["healthy"], h
        client.tsctl("seed")
        client.tsctl("tenant", "create", "demo", "--tier", "standard")
        key = json.loads(client.tsctl("key", "issue", "demo", "--json"))["key"]
        for host, port in (("meter", 50054), ("tok", 50052), ("eng", 50053), ("gw1", 50051),
                           ("gw2", 50051)):
            status = client.call("health", address=f"{HOSTS[host]}:{port}", timeout=120)["status"]
            assert status == "SERVING", f"{host}: {status}; logs in {tmp}"
        # registrations follow SERVING: wait for the engine's and both gateways' leases
        client.wait_status(lambda st: len(st["engines"]) == 1 and len(st["gateways"]) == 2)
        yield net, client, key, procs, tmp
    finally:
        net.close()


def start(net: Network, tmp: Path, env: dict) -> dict:
    py = [sys.executable, "-m"]
    etcd_bin = find_etcd_binary()
    cluster = ",".join(f"{h}=http://{HOSTS[h]}:2380" for h in ETCD)
    procs = {}
    for h in ETCD:
        a = HOSTS[h]
        procs[h] = net.spawn(h, [
            etcd_bin, "--name", h, "--data-dir", str(tmp / h),
            "--listen-client-urls", f"http://{a}:2379", "--advertise-client-urls", f"http://{a}:2379",
            "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls", f"http://{a}:2380",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--log-level", "warn"], log=tmp / f"{h}.log", env=env)
    model = str(default_model_path())
    procs["meter"] = net.spawn("meter", py + [
        "services.meter", "--host", HOSTS["meter"], "--db", str(tmp / "meter.db")],
        log=tmp / "meter.log", env=env)
    procs["tok"] = net.spawn("tok", py + [
        "services.tokenizer", "--host", HOSTS["tok"], "--model", f"{DEFAULT_MODEL_NAME}={model}"],
        log=tmp / "tok.log", env=env)
    procs["eng"] = net.spawn("eng", py + [
        "services.engine", "--host", HOSTS["eng"], "--model-path", model, "--threads", "1",
        "--kv-cache-mb", "64", "--etcd-endpoints", ENDPOINTS,
        "--advertise", f"{HOSTS['eng']}:50053"], log=tmp / "eng.log", env=env)
    for gw in ("gw1", "gw2"):
        procs[gw] = net.spawn(gw, py + [
            "services.gateway", "--host", HOSTS[gw], "--gateway-id", gw,
            "--etcd-endpoints", ENDPOINTS, "--tokenizer", f"{HOSTS['tok']}:50052",
            "--meter", f"{HOSTS['meter']}:50054", "--snapshot", str(tmp / f"{gw}-config.json"),
            "--spool", str(tmp / f"{gw}-spool.db")], log=tmp / f"{gw}.log", env=env)
    return procs


def test_a_request_through_either_gateway_reaches_the_engine_found_in_etcd(cluster):
    net, client, key, procs, tmp = cluster
    status = json.loads(client.tsctl("status", "--json"))
    # the engine registered its address on its own host; the gateways had no --engine flag
    assert [e["endpoint"] for e in status["engines"]] == [f"{HOSTS['eng']}:50053"]
    assert sorted(g["id"] for g in status["gateways"]) == ["gw1", "gw2"]
    for gateway in (GW1, GW2):
        out = client.generate(gateway, key)
        assert out["code"] == "OK", out
        assert out["tokens"] > 0 and out["text"].strip()


def test_tsctl_top_once_shows_each_engine_and_gateway_across_hosts(cluster):
    net, client, key, procs, tmp = cluster
    out = client.call("top_while_generating", gateway=GW1, key=key, max_tokens=200,
                      prompt="Once upon a time, in a small village by the sea, there lived an old baker who",
                      args=["--endpoints", ENDPOINTS, "top", "--once", "--json", "--interval", "1",
                            "--metrics", f"{HOSTS['gw1']}:9101", "--metrics", f"{HOSTS['gw2']}:9101",
                            "--metrics", f"{HOSTS['eng']}:9103"])
    assert out["rc"] == 0, out
    assert out["still_streaming"], "the story ended before top's second scrape"
    view = json.loads(out["out"])
    assert view["etcd_error"] is None and view["unreachable"] == []
    [engine] = view["engines"]
    assert engine["endpoint"] == f"{HOSTS['eng']}:50053" and engine["metrics"] == f"{HOSTS['eng']}:9103"
    assert engine["model"] == DEFAULT_MODEL_NAME
    assert engine["tokens_per_s"] > 0 and engine["running"] == 1  # the story is streaming
    assert 0 < engine["ttft_p50_s"] <= engine["ttft_p99_s"]
    assert 0 < engine["kv_used_fraction"] < 1
    assert sorted(g["metrics"] for g in view["gateways"]) == [f"{HOSTS['gw1']}:9101", f"{HOSTS['gw2']}:9101"]
    assert sorted(view["registered"]["gateways"]) == [f"{HOSTS['gw1']}:50051", f"{HOSTS['gw2']}:50051"]
    gw1 = next(g for g in view["gateways"] if g["metrics"].startswith(HOSTS["gw1"]))
    assert gw1["tokens_per_s"] > 0 and gw1["ttft_p99_s"] > 0
    assert view["totals"]["tokens_per_s"] == engine["tokens_per_s"]


def test_prometheus_scrapes_every_host_and_the_rules_answer(cluster):
    net, client, key, procs, tmp = cluster
    if shutil.which("prometheus") is None:
        message = "prometheus not installed (Debian package prometheus; .ci/run installs it)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    rules = ROOT / "compose" / "prometheus" / "rules.yml"
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(rules)],
              "scrape_configs": [{"job_name": f"tokenserve-{host}",
                                  "static_configs": [{"targets": [f"{HOSTS[host]}:{port}"]}]}
                                 for host, port in METRICS.items()]}
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    procs["mon"] = net.spawn("mon", [
        "prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address={HOSTS['mon']}:9090"], log=tmp / "prometheus.log")
    mon = f"{HOSTS['mon']}:9090"

    def query(q: str, want):
        end, result = time.monotonic() + 30, None
        while time.monotonic() < end:
            result = client.call("prometheus_query", address=mon, query=q)["result"]
            if result and want(result):
                return result
            time.sleep(0.5)
        return result

    up = query('up{job=~"tokenserve-.*"} == 1', lambda r: len(r) == len(METRICS))
    assert sorted(r["metric"]["instance"] for r in up) == sorted(f"{HOSTS[h]}:{p}" for h, p in METRICS.items())
    generated = query("sum(tokenserve_engine_generated_tokens_total)", lambda r: True)
    assert float(generated[0]["value"][1]) > 0  # the tokens the earlier tests streamed
    # a recording rule from compose/prometheus/rules.yml, evaluated over the scraped data
    recorded = query("tokenserve:engine_kv_use:ratio", lambda r: True)
    assert recorded and 0 <= float(recorded[0]["value"][1]) < 1
    net.stop(procs.pop("mon"))


def test_one_etcd_member_killed_the_rest_keep_policy_live(cluster):
    net, client, key, procs, tmp = cluster
    procs["etcd1"].send_signal(signal.SIGKILL)
    procs["etcd1"].wait(10)
    # a write still commits on the two-member quorum, and both gateways apply it
    client.tsctl("tier", "set", "standard", "--max-tokens", "1024")
    revision = json.loads(client.tsctl("status", "--json"))["revision"]
    for gw in ("gw1", "gw2"):
        seen = client.wait_metric(gw, 9101, "tokenserve_gateway_config_revision", lambda v: v >= revision)
        assert seen >= revision, f"{gw} stuck at revision {seen}"
    for gateway in (GW1, GW2):
        assert client.generate(gateway, key)["code"] == "OK"


def test_gateway_partitioned_from_etcd_keeps_last_good_policy_then_recovers(cluster):
    net, client, key, procs, tmp = cluster
    for h in ETCD:
        net.partition("gw1", h)
    try:
        client.tsctl("tenant", "disable", "demo")
        revision = json.loads(client.tsctl("status", "--json"))["revision"]
        assert client.wait_metric("gw2", 9101, "tokenserve_gateway_config_revision",
                                  lambda v: v >= revision) >= revision
        # gw2 sees the change; gw1, cut off from etcd, still serves under its last good policy
        refused = client.generate(GW2, key)
        assert refused["code"] == "PERMISSION_DENIED", refused
        served = client.generate(GW1, key)
        assert served["code"] == "OK", served
        assert client.metric("gw1", 9101, "tokenserve_gateway_config_revision") < revision
    finally:
        for h in ETCD:
            net.rejoin("gw1", h)
    # healed: gw1 catches up by itself and applies the change
    assert client.wait_metric("gw1", 9101, "tokenserve_gateway_config_revision",
                              lambda v: v >= revision, timeout=60) >= revision
    assert client.generate(GW1, key)["code"] == "PERMISSION_DENIED"
    client.tsctl("tenant", "enable", "demo")


def test_gateway_host_cut_off_clients_fail_over_to_the_other(cluster):
    net, client, key, procs, tmp = cluster
    # both gateways serve again once the enable reached them
    revision = json.loads(client.tsctl("status", "--json"))["revision"]
    for gw in ("gw1", "gw2"):
        client.wait_metric(gw, 9101, "tokenserve_gateway_config_revision", lambda v: v >= revision)
    net.cut("gw1")
    try:
        out = client.call("failover", gateways=[GW1, GW2], key=key, prompt=PROMPT, max_tokens=8,
                          timeout=3)
        assert out["code"] == "OK", out
        assert out["served_by"] == GW2
        assert out["tried"][0]["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), out["tried"]
        # gw1's registration lease runs out: etcd no longer lists it
        status = client.wait_status(lambda st: [g["id"] for g in st["gateways"]] == ["gw2"])
        assert [g["id"] for g in status["gateways"]] == ["gw2"]
    finally:
        net.heal("gw1")


def test_an_engine_that_dies_leaves_routing_with_its_lease(cluster):
    net, client, key, procs, tmp = cluster
    procs["eng"].send_signal(signal.SIGKILL)
    procs["eng"].wait(10)
    assert client.wait_status(lambda st: not st["engines"])["engines"] == []
    out = client.generate(GW2, key)
    assert out["code"] == "UNAVAILABLE", out
