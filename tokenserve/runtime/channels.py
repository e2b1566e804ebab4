"""Client channels between services, with the same message limits as the servers, over TLS
when the process has a CA to verify servers with (tokenserve.runtime.tls)."""
from __future__ import annotations

import grpc

from tokenserve.runtime.tls import PLAINTEXT, TlsConfig

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
]


def aio_channel(target: str, *, token: str | None = None,
                tls: TlsConfig = PLAINTEXT) -> grpc.aio.Channel:
    """`token`: a service token every call carries (tokenserve.runtime.service_token);
    `tls`: TLS (and a client certificate) when it has a CA."""
    from tokenserve.runtime.service_token import client_interceptors

    interceptors = client_interceptors(token) or None
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(target, options=_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(target, creds, options=_OPTIONS, interceptors=interceptors)


def sync_channel(target: str, tls: TlsConfig = PLAINTEXT) -> grpc.Channel:
    """A blocking channel (health probes), TLS when `tls` has a CA."""
    creds = tls.channel_credentials()
    return (grpc.insecure_channel(target) if creds is None
            else grpc.secure_channel(target, creds))
