"""Domain errors and the one place they become gRPC status codes.

Logic raises these plain exceptions (no grpc import needed where they are raised); the
`ErrorInterceptor` installed by `tokenserve.runtime.server` turns them into statuses. Any
other exception is a bug: it is logged with its type (never request text) and becomes
INTERNAL.
"""
from __future__ import annotations

import math

import grpc

# Metadata keys of a RESOURCE_EXHAUSTED refusal: milliseconds to wait, the limit that was hit
# (rps, tpm, daily, concurrency, degraded), and `limit-<what>` facts about it (e.g.
# `limit-remaining`). The SDK and the HTTP front read them from here.
RETRY_AFTER_MS = "retry-after-ms"
LIMIT = "limit"
LIMIT_PREFIX = "limit-"


class ServiceError(Exception):
    """Base of every error a caller should see with a precise status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.message = message
        self.metadata = metadata


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    """A limit was hit. Goes to the caller as trailing metadata: `retry-after-ms` (`retry_after`
    seconds, rounded up; "unknown" when a limit was named but no time can be promised),
    `limit` (which one: rps, tpm, daily, concurrency, ...) and `limit-remaining`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after: float | None = None,
                 limit: str | None = None, remaining: int | None = None):
        md: list[tuple[str, str]] = []
        if retry_after is not None:
            md.append((RETRY_AFTER_MS, str(max(0, math.ceil(retry_after * 1000)))))
        elif limit is not None:
            md.append((RETRY_AFTER_MS, "unknown"))
        if limit is not None:
            md.append((LIMIT, limit))
        if remaining is not None:
            md.append((LIMIT_PREFIX + "remaining", str(remaining)))
        super().__init__(message, metadata=tuple(md))
        self.retry_after = retry_after
        self.limit = limit
        self.remaining = remaining


def retry_after_seconds(metadata) -> float | None:
    """`retry-after-ms` of a status's trailing metadata in seconds; None when absent or not a
    number ("unknown")."""
    value = dict(metadata or ()).get(RETRY_AFTER_MS)
    try:
        return float(value) / 1000 if value is not None else None
    except ValueError:
        return None


class Conflict(ServiceError):
    """A concurrent writer changed the same thing first (compare-and-swap lost)."""

    code = grpc.StatusCode.ABORTED


def from_rpc_error(err: grpc.RpcError, *, context: str = "") -> ServiceError:
    """Re-raises a downstream service's status as our own domain error (same code)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    message = f"{context}: {details}" if context else (details or "")
    for cls in (InvalidArgument, NotFound, Unauthenticated, PermissionDenied,
                FailedPrecondition, DeadlineExceeded, Cancelled, Conflict, AlreadyExists):
        if cls.code == code:
            return cls(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        md = (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ()
        limit = dict(md).get(LIMIT)
        return ResourceExhausted(message, retry_after=retry_after_seconds(md), limit=limit)
    return Unavailable(message or f"downstream call failed with {code.name}")
