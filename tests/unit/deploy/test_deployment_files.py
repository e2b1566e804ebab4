"""compose/, deploy/kubernetes/ and the Dockerfile agree with the code: every service command
parses with that service's own argument parser (a flag renamed in code fails here), every
port, probe, scrape target and cross-reference matches what the parsed flags say, and the
files are valid against the Compose specification and the Kubernetes schemas. No container
engine runs here: these are the offline checks (see compose/README.md)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.deployment_files import (
    AWAITING_FLAGS, COMPOSE, KUBERNETES, FlagError, code_metrics, command_list, dockerfile_targets,
    entrypoint_module, host_port, kubernetes_documents, load_compose, parse_service_args,
    tsctl_parser)

KUBERNETES_VERSION = "1.30.0"
SERVICES = ("gateway", "tokenizer", "engine", "meter")
awaiting_seen: set[str] = set()


def _parse(module: str, args: list[str]):
    parsed = parse_service_args(module, args)
    awaiting_seen.update(f"{parsed.service} {f} ({AWAITING_FLAGS[parsed.service][f]})"
                         for f in parsed.awaiting)
    return parsed


# -- Dockerfile ---------------------------------------------------------------------------

def test_dockerfile_targets_start_each_service_with_its_health_check_on_its_default_port():
    targets = dockerfile_targets()
    for name in SERVICES:
        t = targets[name]
        module, args = entrypoint_module(t.entrypoint)
        assert module == f"services.{name}"
        ns = _parse(module, args).ns
        assert ns.host == "0.0.0.0", f"{name}: a container must listen on every interface"
        assert {ns.port, ns.metrics_port} <= t.expose, name
        probe_module, probe_args = entrypoint_module(t.healthcheck)
        assert probe_module == "tokenserve.runtime.health_probe"
        assert probe_args == [f"127.0.0.1:{ns.port}"], name
    assert entrypoint_module(targets["tsctl"].entrypoint) == ("controlplane.tsctl", [])


def test_dockerfile_runs_as_a_non_root_user():
    text = (COMPOSE / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] != "root" and users[0] != "root"
    # the model stage switches to root only to install, then back
    assert all(u == "10001" for u in users if u != "root")


# -- compose ------------------------------------------------------------------------------

def _compose_services(compose: dict) -> dict[str, tuple[str, list[str], dict]]:
    """tokenserve services: compose name -> (module, parsed-args source list, compose entry)."""
    targets = dockerfile_targets()
    out = {}
    for name, svc in compose["services"].items():
        target = (svc.get("build") or {}).get("target")
        if target in SERVICES:
            module, entry_args = entrypoint_module(targets[target].entrypoint)
            out[name] = (module, entry_args + command_list(svc.get("command")), svc)
    return out


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml"])
def test_compose_files_are_valid_against_the_compose_specification(name):
    # compose-spec.json: schema/compose-spec.json of github.com/compose-spec/compose-spec
    # (Apache-2.0), commit 170098ba07d9f53c383a41bfd4c5166b0a4529a6
    schema = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(load_compose(name))]
    assert errors == []


def test_the_compose_schema_check_rejects_a_misspelt_key():
    schema = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
    bad = load_compose()
    bad["services"]["meter"]["healthchek"] = bad["services"]["meter"].pop("healthcheck")
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))


def test_compose_service_commands_parse_with_the_services_own_parsers():
    compose = load_compose()
    services = _compose_services(compose)
    assert sorted({m for m, _, _ in services.values()}) == sorted(f"services.{s}" for s in SERVICES)
    assert sum(m == "services.gateway" for m, _, _ in services.values()) == 2
    for name, (module, args, svc) in services.items():
        ns = _parse(module, args).ns
        assert ns.host == "0.0.0.0", name
        probe = svc["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "tokenserve.runtime.health_probe"], name
        assert probe[4:] == [f"127.0.0.1:{ns.port}"], f"{name}: health check not on --port {ns.port}"
    gpu = load_compose("docker-compose.gpu.yml")["services"]["engine"]
    targets = dockerfile_targets()
    module, entry = entrypoint_module(targets["engine"].entrypoint)
    assert _parse(module, entry + gpu["command"]).ns.device == "cuda"


def test_compose_addresses_point_at_the_services_that_listen_there():
    compose = load_compose()
    services = _compose_services(compose)
    parsed = {name: _parse(module, args).ns for name, (module, args, _) in services.items()}
    by_module = {}
    for name, (module, _, _) in services.items():
        by_module.setdefault(module, []).append(name)

    etcd_clients = {}
    for name, svc in compose["services"].items():
        cmd = command_list(svc.get("command"))
        if cmd[:1] == ["etcd"]:
            url = cmd[cmd.index("--advertise-client-urls") + 1]
            etcd_clients[name] = url.removeprefix("http://")
            cluster = cmd[cmd.index("--initial-cluster") + 1]
            peer = cmd[cmd.index("--initial-advertise-peer-urls") + 1]
            assert f"{cmd[cmd.index('--name') + 1]}={peer}" in cluster.split(","), name
    assert len(etcd_clients) == 3

    def service_at(address: str, module: str, attr: str = "port") -> None:
        host, port = host_port(address)
        assert host in by_module[module], f"{address}: no {module} service named {host}"
        assert int(getattr(parsed[host], attr)) == port, f"{address}: {host} listens elsewhere"

    for name, ns in parsed.items():
        if getattr(ns, "etcd_endpoints", ""):
            assert sorted(ns.etcd_endpoints.split(",")) == sorted(etcd_clients.values()), name
        if services[name][0] == "services.gateway":
            service_at(ns.tokenizer, "services.tokenizer")
            service_at(ns.meter, "services.meter")
            assert re.fullmatch(r"redis://redis:6379/\d+", ns.quota_store), name
            assert "redis" in compose["services"][name]["depends_on"]
        if services[name][0] == "services.engine":
            service_at(ns.advertise, "services.engine")
            service_at(ns.meter, "services.meter")
        if services[name][0] == "services.meter":
            assert ns.db.startswith("postgresql://") and "@postgres:5432/" in ns.db

    # the load balancer sends to every gateway, on the ports they listen on
    nginx = (COMPOSE / "nginx" / "nginx.conf").read_text()
    upstreams = dict(re.findall(r"upstream (\w+) \{(.*?)\}", nginx, re.S))
    gateways = by_module["services.gateway"]
    for upstream, attr in (("gateways_grpc", "port"), ("gateways_http", "http_port")):
        servers = re.findall(r"server ([\w-]+:\d+)", upstreams[upstream])
        assert sorted(servers) == sorted(f"{g}:{int(getattr(parsed[g], attr))}" for g in gateways)
    lb_ports = set(compose["services"]["lb"]["ports"])
    assert {f"{p}:{p}" for p in map(int, re.findall(r"listen (\d+);", nginx))} == lb_ports


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    compose = load_compose()
    services = _compose_services(compose)
    expected = sorted(f"{name}:{_parse(m, a).ns.metrics_port}" for name, (m, a, _) in services.items())
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = sorted(t for job in prom["scrape_configs"] for sc in job["static_configs"]
                     for t in sc["targets"])
    assert targets == expected


def test_seed_command_parses_with_tsctl():
    seed = load_compose()["services"]["seed"]
    assert seed["build"]["target"] == "tsctl"
    assert tsctl_parser().parse_args(seed["command"]).command == "seed"


# -- kubernetes ---------------------------------------------------------------------------

def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files


def test_kubernetes_manifests_are_valid_against_the_kubernetes_schemas():
    docs = kubernetes_documents()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "StatefulSet", "Service",
                                           "PodDisruptionBudget", "HorizontalPodAutoscaler", "Job"}
    for name, doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_check_rejects_an_unknown_field():
    _, deployment = next((n, d) for n, d in kubernetes_documents() if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _pod_specs():
    for _, doc in kubernetes_documents():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc, doc["spec"]["template"]


def test_kubernetes_containers_parse_with_the_services_own_parsers_and_probe_their_ports():
    targets = dockerfile_targets()
    seen = set()
    for doc, template in _pod_specs():
        for c in template["spec"]["containers"]:
            image = c["image"].split(":")[0]
            if not image.startswith("tokenserve/"):
                continue
            target = image.removeprefix("tokenserve/")
            env = {e["name"] for e in c.get("env", [])}
            for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
                assert ref in env, f"{doc['metadata']['name']}: $({ref}) is not in the env"
            if target == "tsctl":
                assert tsctl_parser().parse_args(c["args"]).command == "seed"
                continue
            module, entry = entrypoint_module(targets[target].entrypoint)
            ns = _parse(module, entry + c["args"]).ns
            seen.add(target)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["grpc"] == ns.port and ports["metrics"] == ns.metrics_port, target
            if "http" in ports:
                assert ports["http"] == int(ns.http_port)
            if getattr(ns, "advertise", None):  # what the engine registers in etcd
                assert host_port(ns.advertise)[1] == ns.port, target
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["grpc"]["port"] == ns.port, f"{target} {probe}"
            assert "readinessProbe" in c and "livenessProbe" in c, target
            assert c["resources"]["requests"], target
            ann = template["metadata"]["annotations"]
            assert int(ann["prometheus.io/port"]) == ns.metrics_port, target
    assert seen == set(SERVICES)


def test_kubernetes_addresses_point_at_services_that_reach_the_right_pods():
    docs = kubernetes_documents()
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    workloads = {d["metadata"]["name"]: (d, t) for d, t in _pod_specs()}
    targets = dockerfile_targets()

    def container_port(service: str, port: int) -> int:
        svc = services[service]
        entry = next(p for p in svc["spec"]["ports"] if p["port"] == port)
        selector = svc["spec"]["selector"]
        for _, template in workloads.values():
            if selector.items() <= template["metadata"]["labels"].items():
                for c in template["spec"]["containers"]:
                    for p in c["ports"]:
                        if p.get("name") == entry["targetPort"] or p["containerPort"] == entry["targetPort"]:
                            return p["containerPort"]
        raise AssertionError(f"service {service} port {port} reaches no container port")

    parsed = {}
    for name, (doc, template) in workloads.items():
        c = template["spec"]["containers"][0]
        target = c["image"].split(":")[0].removeprefix("tokenserve/")
        if target in SERVICES:
            module, entry = entrypoint_module(targets[target].entrypoint)
            parsed[target] = _parse(module, entry + c["args"]).ns

    etcd = workloads["etcd"][0]
    members = {f"etcd-{i}.etcd:2379" for i in range(etcd["spec"]["replicas"])}
    for target, ns in parsed.items():
        if getattr(ns, "etcd_endpoints", ""):
            assert set(ns.etcd_endpoints.split(",")) == members, target
            assert container_port("etcd", 2379) == 2379
    gw = parsed["gateway"]
    for address, service in ((gw.tokenizer, "tokenizer"), (gw.meter, "meter"),
                             (parsed["engine"].meter, "meter")):
        host, port = host_port(address)
        assert host == service and container_port(service, port) == parsed[service].port
    redis = re.fullmatch(r"redis://(\w+):(\d+)/\d+", gw.quota_store)
    assert redis and container_port(redis.group(1), int(redis.group(2))) == 6379
    assert container_port("gateway", 50051) == gw.port
    assert container_port("gateway", 8080) == int(gw.http_port)


def test_every_workload_has_a_disruption_budget_and_the_hpa_scales_on_a_tokenserve_metric():
    docs = kubernetes_documents()
    budgets = [d["spec"]["selector"]["matchLabels"] for _, d in docs if d["kind"] == "PodDisruptionBudget"]
    for doc, template in _pod_specs():
        if doc["kind"] != "Job" and doc["metadata"]["name"] != "redis":
            assert any(b.items() <= template["metadata"]["labels"].items() for b in budgets), \
                doc["metadata"]["name"]
    hpa = next(d for _, d in docs if d["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in code_metrics()
    assert hpa["spec"]["scaleTargetRef"]["name"] in {d["metadata"]["name"] for d, _ in _pod_specs()}


def test_promtool_accepts_the_prometheus_config_and_rules(tmp_path):
    if shutil.which("promtool") is None:
        message = "promtool not installed (Debian package prometheus; .ci/run installs it)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    rules = COMPOSE / "prometheus" / "rules.yml"
    config = (COMPOSE / "prometheus" / "prometheus.yml").read_text().replace("/etc/prometheus/rules.yml", str(rules))
    (tmp_path / "prometheus.yml").write_text(config)
    out = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_flag_awaits_another_branch():
    """Runs after the checks above (file order): xfails, naming them, while flags listed in
    AWAITING_FLAGS are still missing from the parsers; passes once they all exist."""
    if awaiting_seen:
        pytest.xfail("flags not in the parsers yet (they come with other branches): "
                     + ", ".join(sorted(awaiting_seen)))


def test_a_flag_the_parser_does_not_know_fails_the_check():
    args = command_list(load_compose()["services"]["tokenizer"]["command"])
    args[args.index("--config-snapshot")] = "--config-snapshott"
    with pytest.raises(FlagError, match="config-snapshott"):
        parse_service_args("services.tokenizer", args)
