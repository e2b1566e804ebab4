"""A small asyncio etcd v3 connection: endpoints with fail-over, user/password, TLS.

Built on the generated etcd v3 stubs that ship with `aetcd` (`aetcd.rpc`); aetcd's own Client
has no TLS, no read-at-revision and no progress requests on watches, all of which the store and
the watcher need. Every failure to reach etcd becomes `Unavailable` with the endpoints named.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc
from aetcd import rpc

from tokenserve.runtime.errors import (FailedPrecondition, InvalidArgument, PermissionDenied,
                                      Unauthenticated, Unavailable)

T = TypeVar("T")

# keep idle connections honest so a dead etcd is noticed without a request
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # a fresh channel must not inherit another channel's connect back-off to the same address
    ("grpc.use_local_subchannel_pool", 1),
)


# The variable a service (and tsctl) reads the etcd password from: never a flag, which any
# process listing would show.
ETCD_PASSWORD_ENV = "TOKENSERVE_ETCD_PASSWORD"


def _check_credentials(o: "EtcdOptions | EtcdCredentials") -> None:
    if (o.user is None) != (o.password is None):
        raise InvalidArgument("etcd user and password must be given together"
                              f" (the password in ${ETCD_PASSWORD_ENV})")
    if (o.cert_file is None) != (o.key_file is None):
        raise InvalidArgument("etcd TLS client cert and key must be given together")
    if o.cert_file and not o.ca_file:
        raise InvalidArgument("etcd TLS client cert needs a CA file (--etcd-ca)")


@dataclass(frozen=True)
class EtcdCredentials:
    """How a service proves itself to etcd and verifies it: user/password, TLS with a CA,
    a client certificate. The flags of add_etcd_auth_args; all None: plaintext, no auth."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self):
        _check_credentials(self)

    def options(self, endpoints: Sequence[str] | str) -> "EtcdOptions":
        return EtcdOptions.of(endpoints, user=self.user, password=self.password,
                              ca_file=self.ca_file, cert_file=self.cert_file,
                              key_file=self.key_file)


def add_etcd_auth_args(parser) -> None:
    """--etcd-ca/--etcd-cert/--etcd-key/--etcd-user of every service; read with
    etcd_credentials_from_args (the password comes from $TOKENSERVE_ETCD_PASSWORD)."""
    g = parser.add_argument_group("etcd authentication (default: plaintext, none)")
    g.add_argument("--etcd-ca", default=None, help="CA certificate of etcd (PEM); enables TLS")
    g.add_argument("--etcd-cert", default=None, help="client certificate for etcd (mutual TLS)")
    g.add_argument("--etcd-key", default=None, help="the private key of --etcd-cert")
    g.add_argument("--etcd-user", default=None,
                   help=f"etcd user; the password is read from ${ETCD_PASSWORD_ENV}")


def etcd_credentials_from_args(a, password: str | None) -> EtcdCredentials:
    """The credentials of parsed add_etcd_auth_args flags; `password` from the environment
    (main.py reads it), used only with --etcd-user."""
    return EtcdCredentials(user=a.etcd_user, password=(password or None) if a.etcd_user else None,
                           ca_file=a.etcd_ca, cert_file=a.etcd_cert, key_file=a.etcd_key)


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd. `endpoints` are host:port; tried in order, rotated on failure."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None  # enables TLS
    cert_file: str | None = None  # client certificate (mutual TLS)
    key_file: str | None = None
    timeout: float = 5.0  # per request, seconds

    def __post_init__(self):
        eps = self.endpoints
        if isinstance(eps, str):
            eps = tuple(e.strip() for e in eps.split(",") if e.strip())
        eps = tuple(e.removeprefix("http://").removeprefix("https://") for e in eps)
        if not eps:
            raise InvalidArgument("etcd endpoints: at least one host:port is required")
        for e in eps:
            host, sep, port = e.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise InvalidArgument(f"etcd endpoint {e!r} must be host:port")
        object.__setattr__(self, "endpoints", eps)
        _check_credentials(self)
        if self.timeout <= 0:
            raise InvalidArgument(f"etcd timeout must be > 0, got {self.timeout}")

    @classmethod
    def of(cls, endpoints: Sequence[str] | str | "EtcdOptions", **kw: Any) -> "EtcdOptions":
        if isinstance(endpoints, EtcdOptions):
            return endpoints
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        return cls(endpoints=tuple(endpoints), **kw)


class EtcdClient:
    """One gRPC channel to the current endpoint plus the KV, Watch and Lease stubs."""

    def __init__(self, options: EtcdOptions):
        self.options = options
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._lock = asyncio.Lock()
        self.kv: rpc.KVStub | None = None
        self.watch: rpc.WatchStub | None = None
        self.lease: rpc.LeaseStub | None = None

    @property
    def endpoint(self) -> str:
        return self.options.endpoints[self._index]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._metadata

    def _open_channel(self) -> grpc.aio.Channel:
        o = self.options
        if o.ca_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(o.ca_file).read_bytes(),
                private_key=Path(o.key_file).read_bytes() if o.key_file else None,
                certificate_chain=Path(o.cert_file).read_bytes() if o.cert_file else None)
            return grpc.aio.secure_channel(self.endpoint, creds, options=_CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(self.endpoint, options=_CHANNEL_OPTIONS)

    async def connect(self) -> None:
        async with self._lock:
            if self._channel is not None:
                return
            self._channel = self._open_channel()
            self.kv = rpc.KVStub(self._channel)
            self.watch = rpc.WatchStub(self._channel)
            self.lease = rpc.LeaseStub(self._channel)
            if self.options.user is not None:
                await self._authenticate()

    async def _authenticate(self) -> None:
        stub = rpc.AuthStub(self._channel)
        try:
            resp = await stub.Authenticate(
                rpc.AuthenticateRequest(name=self.options.user, password=self.options.password),
                timeout=self.options.timeout)
        except grpc.aio.AioRpcError as e:
            await self._drop()
            raise self._translate(e) from None
        self._metadata = (("token", resp.token),)

    async def _drop(self) -> None:
        ch, self._channel, self._metadata = self._channel, None, None
        if ch is not None:
            await ch.close()

    async def reconnect(self, *, rotate: bool = True, failed: grpc.aio.Channel | None = None) -> None:
        """Closes the channel and moves to the next endpoint (for watch/lease streams).

        With `failed`, only if that channel is still the current one: concurrent callers that
        saw the same failure then rotate once, not once each.
        """
        async with self._lock:
            if failed is None or failed is self._channel:
                await self._drop()
                if rotate:
                    self._index = (self._index + 1) % len(self.options.endpoints)
        await self.connect()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs a unary request, trying each endpoint once and re-authenticating once."""
        last: grpc.aio.AioRpcError | None = None
        reauthed = False
        attempts = len(self.options.endpoints)
        while attempts > 0:
            await self.connect()
            channel = self._channel
            try:
                return await fn()
            except grpc.aio.AioRpcError as e:
                last = e
                if (e.code() == grpc.StatusCode.UNAUTHENTICATED and self.options.user
                        and not reauthed and "token" in (e.details() or "")):
                    reauthed = True  # simple tokens expire; get a fresh one
                    await self.reconnect(rotate=False, failed=channel)
                    continue
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._translate(e) from None
                attempts -= 1
                await self.reconnect(rotate=True, failed=channel)
        raise self._translate(last) from None

    def _translate(self, e: grpc.aio.AioRpcError) -> Exception:
        code, details = e.code(), e.details() or ""
        where = ", ".join(self.options.endpoints)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return Unavailable(f"etcd at {where} is unreachable ({code.name.lower()}: {details}); "
                               f"check that etcd runs, the endpoints are right (tsctl: --endpoints;"
                               f" a service: --etcd-endpoints) and, for an etcd that speaks"
                               f" TLS, that --etcd-ca (and --etcd-cert/--etcd-key where it"
                               f" demands client certificates) are given")
        if "user name is empty" in details:  # auth is on and we sent no token
            return Unauthenticated(f"etcd at {where} requires a user and password (tsctl: --user and"
                                   f" ${ETCD_PASSWORD_ENV}; a service: --etcd-user and"
                                   f" ${ETCD_PASSWORD_ENV})")
        if code == grpc.StatusCode.UNAUTHENTICATED or "authentication failed" in details:
            return Unauthenticated(f"etcd at {where} refused the credentials: {details}")
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return PermissionDenied(f"etcd at {where}: {details}")
        if code == grpc.StatusCode.OUT_OF_RANGE:  # e.g. a read at a compacted revision
            return FailedPrecondition(f"etcd at {where}: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(f"etcd at {where}: {details}")
        return Unavailable(f"etcd at {where} failed: {code.name}: {details}")

    # -- the requests the control plane uses --------------------------------------------------

    def _t(self) -> dict:
        return {"timeout": self.options.timeout, "metadata": self._metadata}

    async def range(self, key: bytes, range_end: bytes | None = None, *, revision: int = 0,
                    keys_only: bool = False) -> Any:
        req = rpc.RangeRequest(key=key, range_end=range_end or b"", revision=revision,
                               keys_only=keys_only)
        return await self.call(lambda: self.kv.Range(req, **self._t()))

    async def txn(self, compare: list, success: list, failure: list = ()) -> Any:
        req = rpc.TxnRequest(compare=compare, success=success, failure=list(failure))
        return await self.call(lambda: self.kv.Txn(req, **self._t()))

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> Any:
        req = rpc.PutRequest(key=key, value=value, lease=lease)
        return await self.call(lambda: self.kv.Put(req, **self._t()))

    async def delete(self, key: bytes) -> Any:
        req = rpc.DeleteRangeRequest(key=key)
        return await self.call(lambda: self.kv.DeleteRange(req, **self._t()))

    async def compact(self, revision: int, *, physical: bool = True) -> Any:
        req = rpc.CompactionRequest(revision=revision, physical=physical)
        return await self.call(lambda: self.kv.Compact(req, **self._t()))

    async def grant_lease(self, ttl: int) -> int:
        resp = await self.call(lambda: self.lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), **self._t()))
        return resp.ID

    async def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (-1 when it has expired)."""
        req = rpc.LeaseTimeToLiveRequest(ID=lease_id)
        return (await self.call(lambda: self.lease.LeaseTimeToLive(req, **self._t()))).TTL

    async def revoke_lease(self, lease_id: int) -> None:
        await self.call(lambda: self.lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), **self._t()))


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancels `task` and waits for it to end.

    Cancels again while it runs: in Python 3.11 a cancel that lands as an inner
    `asyncio.wait_for` completes is swallowed, and one cancel would then hang close().
    """
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    if task is not None and not task.cancelled():
        task.exception()  # retrieved so asyncio does not warn; the loop logged it already


def describe(e: BaseException) -> str:
    """A one-line reason for logs: code and details of an RPC error, else the message."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"[:300]
    return (getattr(e, "message", None) or str(e) or type(e).__name__)[:300]


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def compare_mod(key: bytes, revision: int) -> Any:
    """Compare: `key`'s mod revision equals `revision` (0 = the key does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def compare_absent(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)


def op_put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def op_get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
