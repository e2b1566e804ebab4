"""Lease-bound registration of running engines and gateways.

    handle = await register(["127.0.0.1:2379"], "engines",
                            EngineRegistration("engine-0", "127.0.0.1:50053", "smollm2-135m-instruct",
                                               "q4_1", capacity=64), ttl=5)
    ...
    await handle.close()   # revokes the lease: the key goes at once

`register_with_retry` keeps trying (backing off) while etcd is unreachable; the engine and
the gateway register that way, so they serve before etcd is back.

The key lives only while its lease is kept alive (every ttl/3 s, in the background). A process
that dies stops the keep-alives and etcd deletes the key within `ttl` seconds, which the
watchers see as a delete. If the lease is lost (etcd down longer than ttl), the handle
registers again with a new lease once etcd is back. Registrations are not audited: they are
presence, not policy.
"""
from __future__ import annotations

import asyncio
import random
from typing import Sequence

import grpc
import structlog
from aetcd import rpc

from controlplane import schema
from controlplane.etcd_client import EtcdClient, EtcdOptions, describe, stop_task
from tokenserve.runtime.errors import InvalidArgument, ServiceError

# lazy proxy: picks up configure_logging() even when called after this import
log = structlog.get_logger(component="registry")

KINDS = {"engines": schema.EngineRegistration, "gateways": schema.GatewayRegistration}


class RegistrationHandle:
    def __init__(self, client: EtcdClient, registration: schema.Document, ttl: int):
        self.registration = registration
        self.ttl = ttl
        self.key = registration.key
        self.lease_id = 0
        self._client = client
        self._task: asyncio.Task | None = None
        self._closed = False
        self.registered = asyncio.Event()

    async def _register(self) -> None:
        self.lease_id = await self._client.grant_lease(self.ttl)
        await self._client.put((schema.PREFIX + self.key).encode(), schema.encode(self.registration),
                               lease=self.lease_id)
        self.registered.set()
        log.info("registered", key=self.key, lease=self.lease_id, ttl=self.ttl)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        backoff = 0.2
        while not self._closed:
            try:
                if not self.registered.is_set():
                    await self._register()
                await self._stream()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop must outlive any failure; it retries
                log.warning("registration_keepalive_failed", key=self.key,
                            error=describe(e))
                await asyncio.sleep(backoff * (1 + random.random() / 2))
                backoff = min(backoff * 2, max(1.0, self.ttl / 3))
                await self._client.reconnect(rotate=True)
                continue
            backoff = 0.2

    async def _stream(self) -> None:
        """Keeps the lease alive on one stream; returns when the lease is gone."""
        await self._client.connect()
        call = self._client.lease.LeaseKeepAlive(metadata=self._client.metadata)
        try:
            while not self._closed:
                await call.write(rpc.LeaseKeepAliveRequest(ID=self.lease_id))
                resp = await asyncio.wait_for(call.read(), timeout=max(1.0, self.ttl / 2))
                if resp is grpc.aio.EOF:
                    raise ConnectionError("etcd closed the lease keep-alive stream")
                if resp.TTL <= 0:
                    log.warning("registration_lease_expired", key=self.key, lease=self.lease_id)
                    self.registered.clear()  # register again with a fresh lease
                    return
                await asyncio.sleep(self.ttl / 3)
        finally:
            call.cancel()

    async def update(self, registration: schema.Document) -> None:
        """Rewrites the registration under the same lease (a gateway's degradation level);
        kept for the next registration when the lease is being renewed. Raises ServiceError
        when etcd does not take it (the caller retries)."""
        if registration.key != self.key or type(registration) is not type(self.registration):
            raise InvalidArgument(f"update must keep the key {self.key}, got {registration.key}")
        self.registration = registration
        if self.registered.is_set():
            await self._client.put((schema.PREFIX + self.key).encode(), schema.encode(registration),
                                   lease=self.lease_id)

    async def close(self) -> None:
        """Stops the keep-alives and revokes the lease (the key disappears now)."""
        self._closed = True
        await stop_task(self._task)
        self._task = None
        try:
            if self.lease_id:
                await self._client.revoke_lease(self.lease_id)
        except ServiceError as e:  # etcd down: the lease expires on its own within ttl
            log.warning("registration_revoke_failed", key=self.key, error=e.message)
        finally:
            await self._client.close()


def _check(kind: str, registration: schema.Document, ttl: int) -> None:
    cls = KINDS.get(kind)
    if cls is None:
        raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(registration, cls):
        raise InvalidArgument(f"{kind} needs a {cls.__name__}, got {type(registration).__name__}")
    if not isinstance(ttl, int) or ttl < 2:
        raise InvalidArgument(f"ttl must be an integer >= 2 seconds, got {ttl!r}")


async def register(endpoints: Sequence[str] | str | EtcdOptions, kind: str,
                   registration: schema.Document, ttl: int = 5, *, user: str | None = None,
                   password: str | None = None, ca_file: str | None = None,
                   cert_file: str | None = None, key_file: str | None = None) -> RegistrationHandle:
    """Writes `registration` under `<kind>/<id>` bound to a lease with `ttl` seconds."""
    _check(kind, registration, ttl)
    options = EtcdOptions.of(endpoints, user=user, password=password, ca_file=ca_file,
                             cert_file=cert_file, key_file=key_file)
    handle = RegistrationHandle(EtcdClient(options), registration, ttl)
    try:
        await handle._register()
    except BaseException:
        await handle._client.close()
        raise
    handle._start()
    return handle


async def register_with_retry(endpoints: Sequence[str] | str | EtcdOptions, kind: str,
                              registration: schema.Document, ttl: int = 5, *,
                              first_delay: float = 0.5, max_delay: float = 10.0,
                              **auth: str | None) -> RegistrationHandle:
    """`register`, retried until etcd takes it: for a service that serves while etcd is down.

    Waits first_delay seconds after the first failure, doubling up to max_delay (with jitter,
    so services started together do not retry together), and logs each failure. Bad arguments
    raise at once. Cancel the task to give up (on shutdown): no keep-alives are left running,
    so a registration cut short mid-write expires with its lease within ttl seconds.
    """
    _check(kind, registration, ttl)
    delay = first_delay
    while True:
        try:
            return await register(endpoints, kind, registration, ttl, **auth)
        except Exception as e:  # noqa: BLE001 - etcd down or refusing: serving goes on, retry
            wait = delay * (1 + random.random() / 2)
            # describe() gives the error's code and message; never the credentials in `auth`
            log.warning("registration_failed", key=registration.key, error=describe(e),
                        retry_in=round(wait, 2))
            await asyncio.sleep(wait)
            delay = min(delay * 2, max_delay)
