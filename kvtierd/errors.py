"""Client-visible errors of the daemon and the one place that maps them to gRPC codes.

Expected outcomes (MISS, RETRY, ``accepted=false``) are values, not errors.
Client mistakes raise a ``KvtierdError`` subclass named after the resource
state; the service layer turns them into a status with the message. A broken
internal invariant is a bug: it surfaces as INTERNAL and is logged with a trace.
"""

from __future__ import annotations

import grpc


class StartupError(Exception):
    """The daemon cannot start for a reason its operator can fix that is not a bad
    value (a socket or port another process holds, a directory it may not create);
    ``key`` names the option involved (``server.listen``). Exit code 2 and one line
    on stderr, like ``ConfigError``: never a traceback."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class ConfigError(ValueError):
    """An invalid configuration value; ``key`` is its dotted name (``memory.budget``).
    Not a client's error: the daemon refuses to start (exit code 2) or, on SIGHUP,
    keeps its previous credentials."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class KvtierdError(Exception):
    """Base of every error a client can cause; ``code`` is its gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KvtierdError):
    """Malformed input: the message says which field and what is allowed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFound(KvtierdError):
    """The session id is unknown, closed, or its lease expired."""

    code = grpc.StatusCode.NOT_FOUND


class PoolNotFound(KvtierdError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvtierdError):
    """The call is well-formed but the state does not allow it (pool mismatch,
    loading a key that is not HIT, completing keys this session did not pin)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvtierdError):
    """A limit would be exceeded (memory budget, sessions, pools)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(KvtierdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unauthenticated(KvtierdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvtierdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ShuttingDown(KvtierdError):
    code = grpc.StatusCode.UNAVAILABLE


class Unavailable(KvtierdError):
    """Not now, for a reason that passes (a takeover still waiting for the daemon
    it replaces); the client retries."""

    code = grpc.StatusCode.UNAVAILABLE
