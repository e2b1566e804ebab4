"""One way to run a gRPC server: health, reflection, error mapping, metrics, shutdown.

    server = GrpcServer("engine", [Registration(SERVICE_NAME, add_fn, servicer)], opts)
    await server.run()          # returns after SIGTERM/SIGINT and a graceful stop

The server is grpc.aio (handlers are coroutines) unless `ServerOptions.handler_threads` is
set: then a synchronous grpc server whose handlers are plain functions run on that many
threads, for short CPU-bound unary calls (a tokenizer), where it answers ~0.5 ms sooner per
call than grpc.aio on a small machine. Either way the process's asyncio loop owns start,
signals, drain and stop.

Shutdown: health goes NOT_SERVING for every service (`on_drain` hooks end never-ending
streams then), the server keeps answering for
`drain_seconds` so that balancers notice, then `server.stop(grace_seconds)` lets in-flight
calls finish, then `on_stop` hooks run (flush spools, close stores), each for at most
`stop_hook_seconds`. A stop requested by a signal also sets a deadline for the whole exit
(`exit_deadline_seconds` past the drain and grace): a process still alive then (a hook or a
thread that never returns, which would block the interpreter's exit) writes every thread's
stack to stderr and exits with status 70, so a SIGTERMed service always goes away.
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenserve.runtime import errors
from tokenserve.runtime.logging import get_logger
from tokenserve.runtime.metrics import start_metrics_server
from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

log = get_logger(component="server")


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    # None: no metrics endpoint; 0: any free port.
    metrics_port: int | None = None
    grace_seconds: float = 5.0
    drain_seconds: float = 1.0
    max_message_bytes: int = 16 * 1024 * 1024
    # None: grpc.aio server. N: synchronous server, handlers on N threads.
    handler_threads: int | None = None
    # TLS (and with client_auth "require", mutual TLS) on the gRPC port; default plaintext.
    tls: TlsConfig = PLAINTEXT
    # How long each on_stop hook may take before the stop goes on without it.
    stop_hook_seconds: float = 10.0
    # After a signal: how long past drain + grace the process may take to exit, hooks included
    # (within the launcher's 20 s before SIGKILL at the default drain and grace, so its stacks
    # reach the log).
    exit_deadline_seconds: float = 12.0

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace_seconds and drain_seconds must be >= 0")
        if self.stop_hook_seconds <= 0 or self.exit_deadline_seconds <= 0:
            raise ValueError("stop_hook_seconds and exit_deadline_seconds must be > 0")
        if self.handler_threads is not None and self.handler_threads < 1:
            raise ValueError(f"handler_threads must be >= 1, got {self.handler_threads}")


@dataclass(frozen=True)
class Registration:
    """A servicer to mount: its full service name (for health and reflection) and the
    generated `add_XServicer_to_server` function."""

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


async def _abort(context: grpc.aio.ServicerContext, err: errors.ServiceError):
    await context.abort(err.code, err.message, trailing_metadata=tuple(err.metadata))


def _unexpected(method: str, exc: Exception):
    # Type and method only: the exception text may quote request content.
    log.error("unhandled_exception", method=method, exc_type=type(exc).__name__)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps `ServiceError` to its status; anything else becomes INTERNAL and is logged."""

    def __init__(self):
        # the wrapped handler of each method handler, built at its first call
        self._wrapped: dict[Any, Any] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        wrapped = self._wrapped.get(handler)
        if wrapped is None:
            wrapped = self._wrapped[handler] = self._wrap(handler, details.method)
        return wrapped

    @staticmethod
    def _wrap(handler, method: str):
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except errors.ServiceError as e:
                    await _abort(context, e)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:  # noqa: BLE001 - last line of defence
                    _unexpected(method, e)
                    await context.abort(grpc.StatusCode.INTERNAL, "internal error")

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except errors.ServiceError as e:
                    await _abort(context, e)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:  # noqa: BLE001
                    _unexpected(method, e)
                    await context.abort(grpc.StatusCode.INTERNAL, "internal error")

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer)
        return handler


class SyncErrorInterceptor(grpc.ServerInterceptor):
    """ErrorInterceptor for the synchronous server (unary-unary handlers)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not handler.unary_unary:
            return handler
        method, inner = details.method, handler.unary_unary

        def unary_unary(request, context):
            try:
                return inner(request, context)
            except errors.ServiceError as e:
                context.set_trailing_metadata(tuple(e.metadata))
                context.abort(e.code, e.message)
            except Exception as e:  # noqa: BLE001 - last line of defence
                if context.code() is not None:
                    raise  # the handler aborted or set its own status
                _unexpected(method, e)
                context.abort(grpc.StatusCode.INTERNAL, "internal error")

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer)


class GrpcServer:
    def __init__(self, service: str, registrations: list[Registration], options: ServerOptions,
                 *, on_stop: list[Callable[[], Awaitable[None]]] | None = None,
                 on_drain: list[Callable[[], None]] | None = None,
                 interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()):
        self.service = service
        # Run inside the error mapping (grpc.aio servers only), e.g. service_token.RequireToken.
        self.interceptors = tuple(interceptors)
        if self.interceptors and options.handler_threads is not None:
            raise ValueError("extra interceptors need the grpc.aio server (no handler_threads)")
        self.registrations = registrations
        self.options = options
        self.on_stop = list(on_stop or [])
        # Called as health turns NOT_SERVING: end never-ending streams (load reports) so the
        # grace period is left to requests.
        self.on_drain = list(on_drain or [])
        self._sync = options.handler_threads is not None
        self.health = health.HealthServicer() if self._sync else health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.Server | grpc.aio.Server | None = None
        self._stop_requested = asyncio.Event()

    async def start(self, *, serving: bool = True) -> int:
        """Binds and starts; `serving=False` keeps health NOT_SERVING (e.g. while a model
        loads) until `set_serving(True)`."""
        opts = self.options
        grpc_options = [
            ("grpc.max_send_message_length", opts.max_message_bytes),
            ("grpc.max_receive_message_length", opts.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if self._sync:
            server = grpc.server(ThreadPoolExecutor(opts.handler_threads, thread_name_prefix="grpc"),
                                 interceptors=[SyncErrorInterceptor()], options=grpc_options)
        else:
            server = grpc.aio.server(interceptors=[ErrorInterceptor(), *self.interceptors],
                                     options=grpc_options)
        for reg in self.registrations:
            reg.add_to_server(reg.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [r.name for r in self.registrations]
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = f"{opts.host}:{opts.port}"
        self.port = (server.add_secure_port(address, opts.tls.server_credentials())
                     if opts.tls.serves_tls else server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind {opts.host}:{opts.port}")
        if self._sync:
            server.start()
        else:
            await server.start()
        self._server = server
        if opts.metrics_port is not None:
            self.metrics_port = start_metrics_server(opts.metrics_port, opts.host)
        await self.set_serving(serving)
        log.info("serving", service=self.service, port=self.port, metrics_port=self.metrics_port,
                 tls=("mutual" if opts.tls.client_auth == "require"
                      else "on" if opts.tls.serves_tls else "off"))
        return self.port

    async def set_serving(self, serving: bool):
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *(reg.name for reg in self.registrations)):
            if self._sync:
                self.health.set(name, status)
            else:
                await self.health.set(name, status)

    def request_stop(self):
        self._stop_requested.set()

    async def stop(self):
        if self._server is None:
            return
        await self.set_serving(False)
        for hook in self.on_drain:
            hook()
        log.info("draining", service=self.service, seconds=self.options.drain_seconds)
        await asyncio.sleep(self.options.drain_seconds)
        if self._sync:
            await asyncio.to_thread(self._server.stop(self.options.grace_seconds).wait)
        else:
            await self._server.stop(self.options.grace_seconds)
        for hook in self.on_stop:
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                await asyncio.wait_for(hook(), self.options.stop_hook_seconds)
            except asyncio.TimeoutError:
                log.error("stop_hook_timed_out", hook=name, seconds=self.options.stop_hook_seconds)
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                log.error("stop_hook_failed", hook=name, exc_type=type(e).__name__, error=str(e))
        self._server = None
        log.info("stopped", service=self.service)

    async def run(self):
        """Starts, waits for SIGTERM/SIGINT (or `request_stop`), then stops gracefully."""
        if self._server is None:
            await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._signalled)
            except (NotImplementedError, RuntimeError):
                pass
        await self._stop_requested.wait()
        await self.stop()

    def _signalled(self):
        """SIGTERM / SIGINT: the process is to end, so its exit gets a deadline (a stop asked
        for in-process, `request_stop`, does not: the process goes on)."""
        if not self._stop_requested.is_set():
            opts = self.options
            _exit_by(self.service, opts.drain_seconds + opts.grace_seconds + opts.exit_deadline_seconds)
        self.request_stop()


EXIT_DEADLINE_STATUS = 70  # EX_SOFTWARE: the stop did not finish by its deadline


def _exit_by(service: str, seconds: float) -> None:
    """Ends the process `seconds` from now if it is still alive: the stacks of all threads to
    stderr (what it was stuck on), then os._exit. A daemon timer, so a clean exit is not held."""
    def expire():
        log.error("exit_deadline_passed", service=service, seconds=round(seconds, 1))
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_DEADLINE_STATUS)

    timer = threading.Timer(seconds, expire)
    timer.name = f"exit-deadline-{service}"
    timer.daemon = True
    timer.start()
