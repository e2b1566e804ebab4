"""Client channels between services, with the same message limits as the servers."""
from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
]


def aio_channel(target: str, *, token: str | None = None) -> grpc.aio.Channel:
    """`token`: a service token every call carries (tokenserve.runtime.service_token)."""
    from tokenserve.runtime.service_token import client_interceptors

    return grpc.aio.insecure_channel(target, options=_OPTIONS,
                                     interceptors=client_interceptors(token) or None)
