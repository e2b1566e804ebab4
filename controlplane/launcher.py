"""`tokenserve up`: the whole suite on one machine.

Starts a local etcd, seeds the default configuration, starts every service as its own
process by module name (never by importing it), waits for each to report SERVING, issues a
demo API key and prints ready grpcurl and curl commands. Then it supervises: a process that
exits (a crash, a SIGKILL) is restarted with backoff while the others keep serving, each
restart printed and counted in `<data-dir>/up.json`; repeated crashes of one process in a
short window (controlplane.supervision) make it give up and stop everything. Ctrl-C (or
SIGTERM) stops the services in reverse order, gracefully, then etcd.

`--tls` makes a throw-away CA and one certificate for 127.0.0.1/localhost under
`<data-dir>/tls/` (controlplane.certs): etcd then demands client certificates, the meter,
tokenizer and engine demand them of their callers (mutual TLS), the gateway serves TLS on
gRPC and HTTPS (tenants authenticate with API keys, not certificates), and every process
dials the others with the CA and presents the certificate.

`Suite` is the same thing as a library, used by the end-to-end tests with ephemeral ports.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from controlplane import admin
from controlplane import seed as seeding
from controlplane.certs import CertFiles, local_suite_certs
from controlplane.etcd_client import EtcdOptions
from controlplane.etcd_local import EtcdProcess, ServerTls
from controlplane.service_process import SERVING, ServiceProcess
from controlplane.store import ConfigStore
from controlplane.supervision import CrashHistory, GiveUp, RestartPolicy
from tokenserve.client import Client
from tokenserve.client_errors import AuthenticationError, TokenserveError
from tokenserve.runtime.errors import ServiceError
from tokenserve.runtime.ports import free_port
from tokenserve.runtime.service_token import METER_TOKEN_ENV
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig
from tokenserve.models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, default_model_path

DEMO_TENANT = "demo"
DEMO_TIER = "standard"
# Services in start order; stopped in reverse.
SERVICES = ("meter", "tokenizer", "engine", "gateway")


@dataclass(frozen=True)
class SuitePorts:
    gateway: int = 50051
    gateway_http: int = 8080
    tokenizer: int = 50052
    engine: int = 50053
    meter: int = 50054
    etcd: int = 2379
    etcd_peer: int = 2380
    gateway_metrics: int = 9101
    tokenizer_metrics: int = 9102
    engine_metrics: int = 9103
    meter_metrics: int = 9104

    @classmethod
    def ephemeral(cls) -> "SuitePorts":
        return cls(**{name: free_port() for name in cls.__dataclass_fields__})


@dataclass
class Suite:
    data_dir: Path
    ports: SuitePorts = field(default_factory=SuitePorts)
    model_path: Path | None = None
    engine_args: tuple[str, ...] = ()
    say: Callable[[str], None] = print
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    etcd: EtcdProcess | None = None
    # Restarts per process since start (see supervise).
    restarts: dict[str, int] = field(default_factory=dict)
    # Set: the meter demands it of every caller; the gateway and the engine send it.
    meter_token: str | None = field(default=None, repr=False)
    # Set: TLS everywhere with these files (see the module docstring); None: plaintext.
    tls: CertFiles | None = None

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.etcd}"

    @property
    def etcd_options(self) -> EtcdOptions:
        if self.tls is None:
            return EtcdOptions([self.etcd_endpoint])
        return EtcdOptions([self.etcd_endpoint], ca_file=str(self.tls.ca),
                           cert_file=str(self.tls.cert), key_file=str(self.tls.key))

    @property
    def client_tls(self) -> TlsConfig:
        """How this launcher (and a test) reaches the services: the CA and the certificate."""
        if self.tls is None:
            return PLAINTEXT
        return TlsConfig(str(self.tls.cert), str(self.tls.key), str(self.tls.ca))

    def address(self, service: str) -> str:
        return f"127.0.0.1:{getattr(self.ports, service)}"

    @property
    def http_url(self) -> str:
        """Base URL of the gateway's OpenAI-compatible API (ends in /v1)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.ports.gateway_http}/v1"

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> None:
        self.start_etcd()
        asyncio.run(self._seed())
        deadline = time.monotonic() + timeout
        for name in SERVICES:
            proc = self._process(name)
            self.say(f"starting {name} on {self.address(name)} (log: {proc.log_path})")
            self.procs[name] = proc.spawn()
            progress = _ProgressTail(proc.log_path, self.say) if name == "engine" else None
            proc.wait_serving(deadline - time.monotonic(), progress.poll if progress else None)
            self.say(f"{name} is serving")
        self._write_state()

    def start_etcd(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        self.say(f"starting etcd on {self.etcd_endpoint}")
        tls = None if self.tls is None else ServerTls(
            str(self.tls.cert), str(self.tls.key), str(self.tls.ca), client_cert_auth=True)
        self.etcd = EtcdProcess(self.data_dir / "etcd", client_port=self.ports.etcd,
                                peer_port=self.ports.etcd_peer,
                                log_path=self.data_dir / "logs" / "etcd.log", tls=tls)
        self.etcd.start()

    async def _seed(self):
        store = ConfigStore(self.etcd_options)
        try:
            await seeding.seed(store, actor="tokenserve-up")
            if await store.get(f"tenants/{DEMO_TENANT}") is None:
                await admin.create_tenant(store, DEMO_TENANT, "Demo tenant", DEMO_TIER,
                                          actor="tokenserve-up")
        finally:
            await store.close()

    def issue_key(self, tenant: str = DEMO_TENANT) -> str:
        """Issues an API key for tenant; the key is returned once, etcd keeps its hash."""

        async def issue():
            store = ConfigStore(self.etcd_options)
            try:
                key, _record, _revision = await admin.issue_key(store, tenant, actor="tokenserve-up")
                return key
            finally:
                await store.close()

        key = asyncio.run(issue())
        self._wait_until_accepted(key)
        return key

    def _wait_until_accepted(self, key: str, timeout: float = 10.0) -> None:
        """The gateway learns a new key from its etcd watch, a moment after the write (longer
        on a busy machine): the key is handed out once a call with it is no longer refused as
        unknown, so it works when it is pasted or used at once. A gateway that is not up
        (or any other answer) ends the wait."""
        tls = self.tls
        with Client(self.address("gateway"), key, timeout=2.0,
                    tls_ca=str(tls.ca) if tls else None) as client:
            end = time.monotonic() + timeout
            while True:
                try:
                    client.list_models()
                    return
                except AuthenticationError:
                    if time.monotonic() > end:
                        return
                    time.sleep(0.05)
                except TokenserveError:
                    return

    def _process(self, name: str) -> ServiceProcess:
        env = ({METER_TOKEN_ENV: self.meter_token}
               if self.meter_token and name in ("meter", "gateway", "engine") else {})
        return ServiceProcess(f"services.{name}", self._args(name) + self._tls_args(name),
                              getattr(self.ports, name),
                              log_path=self.data_dir / "logs" / f"{name}.log", env=env,
                              tls=self.client_tls)

    def _tls_args(self, name: str) -> list[str]:
        if self.tls is None:
            return []
        t = self.tls
        args = ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca),
                "--etcd-ca", str(t.ca), "--etcd-cert", str(t.cert), "--etcd-key", str(t.key)]
        # internal services take only callers with a certificate; the gateway is public
        return args + ([] if name == "gateway" else ["--tls-client-auth", "require"])

    def _args(self, name: str) -> list[str]:
        p = self.ports
        etcd = ["--etcd-endpoints", self.etcd_endpoint]
        model = str(self.model_path or default_model_path())
        if name == "meter":
            return ["--port", str(p.meter), "--metrics-port", str(p.meter_metrics),
                    "--db", str(self.data_dir / "meter.db"), *etcd,
                    "--config-snapshot", str(self.data_dir / "meter-config.json")]
        if name == "tokenizer":
            return ["--port", str(p.tokenizer), "--metrics-port", str(p.tokenizer_metrics),
                    "--model", f"{DEFAULT_MODEL_NAME}={model}", *etcd,
                    "--config-snapshot", str(self.data_dir / "tokenizer-config.json")]
        if name == "engine":
            return ["--port", str(p.engine), "--metrics-port", str(p.engine_metrics),
                    "--model-path", model, "--model-name", DEFAULT_MODEL_NAME,
                    "--version", DEFAULT_MODEL_VERSION, *etcd,
                    "--meter", self.address("meter"),
                    "--spool", str(self.data_dir / "engine-spool.db"), *self.engine_args]
        if name == "gateway":
            return ["--port", str(p.gateway), "--metrics-port", str(p.gateway_metrics),
                    "--http-port", str(p.gateway_http), *etcd,
                    "--tokenizer", self.address("tokenizer"), "--meter", self.address("meter"),
                    "--snapshot", str(self.data_dir / "gateway-config.json"),
                    "--spool", str(self.data_dir / "gateway-spool.db")]
        raise ValueError(f"unknown service {name}")

    def _write_state(self):
        state = {"ports": asdict(self.ports),
                 "pids": {n: p.proc.pid for n, p in self.procs.items()},
                 "etcd_pid": self.etcd.process.pid if self.etcd and self.etcd.process else None,
                 "restarts": dict(self.restarts),
                 "tls": None if self.tls is None else {k: str(v) for k, v in asdict(self.tls).items()}}
        tmp = self.data_dir / "up.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.data_dir / "up.json")  # readers never see half a file

    # -- supervise -----------------------------------------------------------------------
    def supervise(self, policy: RestartPolicy = RestartPolicy(), tick: float = 0.25) -> str:
        """Restarts every process that exits, after the policy's backoff, while the others
        keep running; returns (without stopping anything) the message of giving up."""
        crashes = CrashHistory(policy)
        due: dict[str, float] = {}    # process -> monotonic time of its restart
        starting: set[str] = set()    # restarted, not yet SERVING again
        names = (["etcd"] if self.etcd else []) + [n for n in SERVICES if n in self.procs]
        while True:
            for name in names:
                if name in due:
                    if time.monotonic() >= due[name]:
                        del due[name]
                        self._restart(name)
                        starting.add(name)
                    continue
                code = self._exit_code(name)
                if code is None:
                    if name in starting and self._serving(name):
                        starting.discard(name)
                        self.say(f"{name} is serving again")
                    continue
                starting.discard(name)
                decision = crashes.crashed(name)
                if isinstance(decision, GiveUp):
                    return (f"{name} exited with code {code}: {decision.crashes} crashes within"
                            f" {decision.window:g} s; giving up, stopping everything"
                            f" (see {self._log_path(name)})")
                self.restarts = dict(crashes.restarts)
                due[name] = time.monotonic() + decision.delay
                self.say(f"{name} exited with code {code}; restart {decision.attempt} in"
                         f" {decision.delay:g} s (restarts so far: {self.restarts})")
                self._write_state()
            time.sleep(tick)

    def _exit_code(self, name: str) -> int | None:
        if name == "etcd":
            return self.etcd.process.poll() if self.etcd and self.etcd.process else None
        return self.procs[name].proc.poll()

    def _serving(self, name: str) -> bool:
        if name == "etcd":
            return self.etcd.healthy()
        return self.procs[name].health() == SERVING

    def _log_path(self, name: str) -> Path:
        return self.data_dir / "logs" / f"{name}.log"

    def _restart(self, name: str) -> None:
        if name == "etcd":
            try:
                # a restart keeps the data dir: etcd comes back with every key it had
                self.etcd.start()
            except ServiceError as e:  # exited again while starting: the next tick sees it
                self.say(f"etcd failed to restart: {e.message}")
            pid = self.etcd.process.pid
        else:
            pid = self.procs[name].spawn().proc.pid
        self.say(f"{name} restarted (pid {pid})")
        self._write_state()

    # -- stop ----------------------------------------------------------------------------
    def stop(self, grace: float = 15.0) -> dict[str, int | None]:
        """Stops services in reverse order (SIGTERM, then SIGKILL after grace); returns exit codes."""
        codes: dict[str, int | None] = {}
        for name in reversed(SERVICES):
            if name in self.procs:
                codes[name] = self.procs[name].stop(grace)
        self.procs.clear()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        return codes


class _ProgressTail:
    """Follows the engine's JSON log and echoes model-load progress events."""

    def __init__(self, path: Path, say: Callable[[str], None]):
        self.path, self.say, self.offset, self.last = path, say, 0, -1

    def poll(self):
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        lines = chunk.split(b"\n")
        self.offset += len(chunk) - len(lines[-1])
        for raw in lines[:-1]:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            done = rec.get("tensors_done", rec.get("done"))
            total = rec.get("tensors_total", rec.get("total"))
            if done is not None and total:
                pct = int(100 * done / total)
                if pct // 10 != self.last // 10:
                    self.last = pct
                    self.say(f"  loading model: {pct}% ({done}/{total} tensors)")
            elif rec.get("event") == "model_loaded":
                self.say(f"  model loaded in {rec.get('seconds', '?')} s")


def grpcurl_command(key: str, gateway: str, cacert: Path | None = None) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32})
    local = Path(sys.executable).parent / "grpcurl"
    grpcurl = os.path.relpath(local) if local.exists() and not shutil.which("grpcurl") else "grpcurl"
    transport = "-plaintext" if cacert is None else f"-cacert {cacert}"
    return (f"{grpcurl} {transport} -H 'authorization: Bearer {key}' -d '{body}' "
            f"{gateway} tokenserve.gateway.v1.InferenceService/Chat")


def curl_command(key: str, base_url: str, cacert: Path | None = None) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32})
    tls = "" if cacert is None else f" --cacert {cacert}"
    return (f"curl{tls} {base_url}/chat/completions -H 'authorization: Bearer {key}'"
            f" -H 'content-type: application/json' -d '{body}'")


def _token_path(data_dir: Path) -> Path:
    return data_dir / "meter-token"


def _meter_token(data_dir: Path) -> str:
    """A fresh service token for the meter, also written (owner-only) for tsctl."""
    token = secrets.token_urlsafe(32)
    data_dir.mkdir(parents=True, exist_ok=True)
    path = _token_path(data_dir)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _up(args) -> int:
    data_dir = Path(args.data_dir).resolve()
    ports = SuitePorts.ephemeral() if args.ephemeral_ports else SuitePorts()
    suite = Suite(data_dir, ports, model_path=Path(args.model_path) if args.model_path else None,
                  engine_args=tuple(args.engine_arg), say=lambda m: print(m, flush=True),
                  meter_token=_meter_token(data_dir),
                  tls=local_suite_certs(data_dir / "tls") if args.tls else None)
    ca = suite.tls.ca if suite.tls else None

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        suite.start()
        key = suite.issue_key()
        print(f"\ntokenserve is up. Gateway: {suite.address('gateway')}  etcd: {suite.etcd_endpoint}")
        print(f"Demo tenant '{DEMO_TENANT}' ({DEMO_TIER} tier) API key (shown once):\n  {key}\n")
        print("Try it:\n  " + grpcurl_command(key, suite.address("gateway"), ca) + "\n")
        print(f"OpenAI-compatible HTTP API: {suite.http_url}\n  "
              + curl_command(key, suite.http_url, ca) + "\n")
        creds = "" if suite.tls is None else (
            f" --etcd-ca {suite.tls.ca} --etcd-cert {suite.tls.cert} --etcd-key {suite.tls.key}")
        service_tls = "" if suite.tls is None else (
            f" --tls-ca {suite.tls.ca} --tls-cert {suite.tls.cert} --tls-key {suite.tls.key}")
        print(f"Admin: tsctl --endpoints {suite.etcd_endpoint}{creds} status")
        print(f"Usage: TOKENSERVE_METER_TOKEN=$(cat {_token_path(data_dir)}) tsctl{service_tls}"
              f" usage --meter {suite.address('meter')}  (the meter wants its service token)")
        print("Press Ctrl-C to stop.", flush=True)
        print(suite.supervise(), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError, ServiceError) as e:
        print(f"tokenserve up failed: {e}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C or SIGTERM must not interrupt the stop and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        codes = suite.stop()
        print("stopped: " + ", ".join(f"{n}={c}" for n, c in codes.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the whole suite on this machine")
    up.add_argument("--data-dir", default="var", help="etcd data, meter db, logs (default: var)")
    up.add_argument("--model-path", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    up.add_argument("--ephemeral-ports", action="store_true",
                    help="pick free ports instead of the defaults 50051-50054 / 2379")
    up.add_argument("--engine-arg", action="append", default=[],
                    help="extra argument passed to the engine (repeatable)")
    up.add_argument("--tls", action="store_true",
                    help="TLS everywhere: a throw-away CA and certificate under <data-dir>/tls,"
                         " etcd and the internal services demanding client certificates")
    args = parser.parse_args(argv)
    if args.command == "up":
        return _up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
