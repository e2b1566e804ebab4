"""A shared secret that an internal service demands of its callers (the meter: only the
gateway, the engines and operators may record or read usage), sent as
`authorization: Bearer <token>`.

    server = GrpcServer(..., interceptors=[RequireToken(token, "tokenserve.meter.v1.")])
    channel = aio_channel(target, token=token)   # every call carries it

Health and reflection stay open (probes and grpcurl need no secret). The token is compared in
constant time and never logged.
"""
from __future__ import annotations

import hmac

import grpc

# The variable each side reads the meter's token from (in main.py / tsctl only).
METER_TOKEN_ENV = "TOKENSERVE_METER_TOKEN"


def check_token(token: str) -> str:
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError("a service token must be at least 16 characters, without spaces")
    return token


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses calls to methods under `prefix` (e.g. "tokenserve.meter.v1.") without the
    token: UNAUTHENTICATED, before the handler runs."""

    def __init__(self, token: str, prefix: str):
        self._expected = f"Bearer {check_token(token)}".encode()
        self._prefix = "/" + prefix

    def _allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or not details.method.startswith(self._prefix)
                or self._allowed(details.invocation_metadata)):
            return handler
        service = details.method[1:].split("/")[0]

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{service} needs its service token (authorization: Bearer"
                                " <token>); API keys are not accepted here")

        if handler.unary_stream:
            async def refuse_stream(request, context):
                await refuse(request, context)
                yield  # pragma: no cover - abort raises

            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer)


class _SendToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = [*(d.metadata or ()), self._header]
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials,
                                          d.wait_for_ready)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def client_interceptors(token: str | None) -> list:
    """Interceptors for a grpc.aio channel whose every call carries `token` (none: [])."""
    return [_SendToken(token)] if token else []
