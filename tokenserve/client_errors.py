"""The SDK's exceptions and its retry policy (imported by, and re-exported from,
`tokenserve.client`).

Every failed call raises a `TokenserveError` subclass carrying the gRPC status code, the
server's message and, for limits, `retry_after` (seconds), `limit` (which one: rps, tpm,
daily, concurrency, degraded) and `remaining`. `RetryPolicy` decides whether and when a call
that failed before its first token is tried again.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from tokenserve.runtime.errors import LIMIT, LIMIT_PREFIX, RETRY_AFTER_MS


class TokenserveError(Exception):
    """A failed call: `code` (grpc.StatusCode), `message`, and for limits `retry_after`
    (seconds or None), `limit` (the limit hit, or None) and `remaining` (or None)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None,
                 *, limit: str | None = None, remaining: int | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.limit = limit
        self.remaining = remaining


class AuthenticationError(TokenserveError):
    """Missing, unknown or revoked API key (UNAUTHENTICATED)."""


class PermissionDeniedError(TokenserveError):
    """The key is valid but may not do this, e.g. its tenant is disabled (PERMISSION_DENIED)."""


class InvalidRequestError(TokenserveError):
    """A field is out of range; the message names it (INVALID_ARGUMENT)."""


class NotFoundError(TokenserveError):
    """Unknown model; the message lists the available ones (NOT_FOUND)."""


class RateLimitError(TokenserveError):
    """A limit or quota was hit, or the service is shedding load (RESOURCE_EXHAUSTED): wait
    `retry_after` seconds; `limit` says which."""


class UnavailableError(TokenserveError):
    """No engine or service could take the request now; retrying later may work."""


class DeadlineExceededError(TokenserveError):
    """The call ran past its timeout."""


_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _number(value: str | None, kind=float):
    try:
        return None if value is None else kind(value)
    except ValueError:
        return None


def error_from_rpc(err: grpc.RpcError) -> TokenserveError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or code.name
    try:
        trailing = {k: v for k, v in err.trailing_metadata() or ()}
    except (AttributeError, TypeError, ValueError):
        trailing = {}
    ms = _number(trailing.get(RETRY_AFTER_MS))
    return _ERRORS.get(code, TokenserveError)(
        code, details, None if ms is None else ms / 1000, limit=trailing.get(LIMIT),
        remaining=_number(trailing.get(LIMIT_PREFIX + "remaining"), int))


# Worth another try: nothing was generated, and the server may take it a moment later.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a call that failed with UNAVAILABLE or RESOURCE_EXHAUSTED before its first
    token: after the server's `retry_after` when it gives one, else after an exponential
    backoff with jitter. A wait longer than `max_wait` or than the call's time left is not
    taken: the error is raised at once (`max_retries=0` turns retries off)."""

    max_retries: int = 3
    max_wait: float = 10.0
    backoff: float = 0.2

    def __post_init__(self):
        if self.max_retries < 0 or self.max_wait < 0 or self.backoff < 0:
            raise ValueError("max_retries, max_wait and backoff must be >= 0")

    def wait(self, err: TokenserveError, attempt: int, time_left: float,
             rng: random.Random = random._inst) -> float | None:
        """Seconds to wait before retry number `attempt` (1 for the first), or None."""
        if attempt > self.max_retries or err.code not in RETRYABLE:
            return None
        if err.retry_after is not None:
            wait = err.retry_after
        else:
            wait = self.backoff * 2 ** (attempt - 1) * (0.5 + rng.random() / 2)
        return wait if wait <= min(self.max_wait, time_left) else None
