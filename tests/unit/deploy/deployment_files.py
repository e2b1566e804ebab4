"""Reads the deployment files and the services' real argument parsers, for the checks in
this folder. Nothing here knows a flag name: the parsers are the services' own."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "compose"
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCKERFILE = COMPOSE / "Dockerfile"

# Flags the deployment files use that arrive with other issues' branches. Until those merge,
# the parser lacks them: the checks then skip the flag (and say so) instead of failing.
# Delete an entry once its branch is merged; then a renamed flag fails like any other.
AWAITING_FLAGS: dict[str, dict[str, str]] = {}


class FlagError(Exception):
    pass


class _Captured(Exception):
    pass


def service_parser(module: str) -> argparse.ArgumentParser:
    """The ArgumentParser that `module`'s parse_args builds (caught as it parses), with
    errors raised as FlagError instead of exiting."""
    main = importlib.import_module(f"{module}.main")

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main.parse_args([])
        except _Captured as c:
            parser = c.args[0]
        else:
            raise AssertionError(f"{module}.main.parse_args never called ArgumentParser.parse_args")
    parser.error = _raise
    return parser


def tsctl_parser() -> argparse.ArgumentParser:
    from controlplane.tsctl_args import build_parser

    parser = build_parser(default_endpoints="127.0.0.1:2379", default_actor="test")
    for action in parser._subparsers._group_actions:  # subcommands error through their own parser
        for sub in action.choices.values():
            sub.error = _raise
    parser.error = _raise
    return parser


def _raise(message: str):
    raise FlagError(message)


@dataclass
class Parsed:
    service: str            # "gateway", "engine", ...
    ns: argparse.Namespace  # every flag's value, defaults included
    awaiting: list[str]     # flags not in the parser yet (AWAITING_FLAGS)


def parse_service_args(module: str, args: list[str]) -> Parsed:
    """Parses args with the service's real parser; raises FlagError for an unknown flag or bad
    value. Flags listed in AWAITING_FLAGS and missing from the parser are set raw."""
    service = module.rsplit(".", 1)[-1]
    parser = service_parser(module)
    known = {s for a in parser._actions for s in a.option_strings}
    rest, raw, awaiting = [], {}, []
    it = iter(args)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in AWAITING_FLAGS.get(service, {}) and flag not in known:
            raw[flag] = value if eq else next(it)
            awaiting.append(flag)
        else:
            rest.append(arg)
    ns = parser.parse_args(rest)
    for flag, value in raw.items():
        setattr(ns, flag.lstrip("-").replace("-", "_"), value)
    return Parsed(service, ns, awaiting)


# -- Dockerfile ---------------------------------------------------------------------------

@dataclass
class Target:
    name: str
    entrypoint: list[str]
    expose: set[int]
    healthcheck: list[str]


def dockerfile_targets() -> dict[str, Target]:
    """Each `FROM ... AS name` stage with its ENTRYPOINT, EXPOSE and HEALTHCHECK CMD."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    targets: dict[str, Target] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I):
            base = targets.get(m.group(1))
            current = targets[m.group(2)] = Target(m.group(2), list(base.entrypoint) if base else [],
                                                   set(base.expose) if base else set(),
                                                   list(base.healthcheck) if base else [])
        elif current is None:
            continue
        elif line.startswith("ENTRYPOINT"):
            current.entrypoint = yaml.safe_load(line.split(None, 1)[1])
        elif line.startswith("EXPOSE"):
            current.expose |= {int(p) for p in line.split()[1:]}
        elif line.startswith("HEALTHCHECK"):
            current.healthcheck = yaml.safe_load(line.split("CMD", 1)[1].strip())
    return targets


def entrypoint_module(entrypoint: list[str]) -> tuple[str, list[str]]:
    """["python", "-m", "services.gateway", "--host", "0.0.0.0"] -> ("services.gateway", [...])."""
    i = entrypoint.index("-m")
    return entrypoint[i + 1], entrypoint[i + 2:]


# -- compose and kubernetes ---------------------------------------------------------------

def load_compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def kubernetes_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def command_list(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# -- metrics --------------------------------------------------------------------------------

_DEFINITION = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"(tokenserve_[a-z0-9_]+)\"")
_SUFFIXES = {"Counter": ("", "_total", "_created"), "Gauge": ("",),
             "Histogram": ("_bucket", "_sum", "_count", "_created"),
             "Summary": ("", "_sum", "_count", "_created")}


# the config watcher's gauges, named after the service that runs it (controlplane/watcher.py)
_WATCHER_GAUGE = re.compile(r'_gauge\(reg, f"tokenserve_\{service\}_([a-z0-9_]+)"')
_WATCHER_SERVICE = re.compile(r'ConfigWatcher\((?:[^()]|\([^()]*\))*?service="([a-z]+)"', re.S)


def code_metrics() -> dict[str, str]:
    """Every series name the services' prometheus_client definitions expose -> its source file."""
    names = {}
    sources = sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "controlplane").rglob("*.py"))
    for path in sources:
        for kind, name in _DEFINITION.findall(path.read_text()):
            base = name[:-len("_total")] if kind == "Counter" and name.endswith("_total") else name
            for suffix in _SUFFIXES[kind]:
                names[base + suffix] = str(path.relative_to(ROOT))
    gauges = _WATCHER_GAUGE.findall((ROOT / "controlplane" / "watcher.py").read_text())
    for path in sources:
        for service in _WATCHER_SERVICE.findall(path.read_text()):
            names.update({f"tokenserve_{service}_{g}": "controlplane/watcher.py" for g in gauges})
    return names


def queried_metrics(expr: str) -> set[str]:
    """tokenserve_* series names a PromQL expression reads."""
    return set(re.findall(r"(?<![:\w])tokenserve_[a-z0-9_]+", expr))
