"""Exceptions of the kvtierd client: one class per gRPC status code.

Every call of ``kvtierd_client.client`` and ``kvtierd_client.aio`` raises a
``KvtierError`` subclass, never a ``grpc.RpcError``. ``str(err)`` reads
``"CODE_NAME: details"``; ``err.code`` is the ``grpc.StatusCode`` and
``err.details`` the daemon's message (or the client's, for local checks).

Raised without the ``grpc.RpcError`` (or socket error) it stands for shown: the
message already carries its code and details, and a traceback of the client's
failure to connect is a few lines, not thirty. That error is still there for a
debugger: ``err.__context__`` (``raise ... from None`` only hides it).
"""

from __future__ import annotations

import grpc


class KvtierError(Exception):
    """Base of every client error; ``code`` is the gRPC status, ``details`` the message.

    ``address`` is the daemon address the call went to ("" when unknown).
    """

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self, details: str = "", code: grpc.StatusCode | None = None, address: str = ""
    ) -> None:
        code = self.default_code if code is None else code
        super().__init__(details, code, address)  # args keep pickling lossless
        self.code: grpc.StatusCode = code
        self.details: str = details
        self.address: str = address

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(KvtierError):
    """Malformed input: empty or oversized key, bad block size, duplicate keys, ..."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvtierError):
    """The session is unknown, closed, or its lease expired."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvtierError):
    """Well-formed but not allowed now: pool mismatch, loading a key that is not HIT, ..."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvtierError):
    """A limit would be exceeded (the memory budget cannot fit a new pool, ...)."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(KvtierError):
    """Events asked for (or not yet sent on a stream) are no longer in the pool's
    bounded log; the message says which ``after_seq`` to resume from."""

    default_code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(KvtierError):
    """The daemon cannot be reached: it is not running or its socket is not accessible."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvtierError):
    """The daemon did not answer within the call's deadline."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(KvtierError):
    """No valid bearer token (TCP listeners)."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvtierError):
    """The token does not allow this pool or call."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class UntrustedAddress(PermissionDenied):
    """The daemon's address, or a path or socket it announced, could be another
    user's: nothing was sent to it and nothing of it was mapped. The message names
    the path and what to fix (``kvtierd_client.wire.trust``)."""


class Internal(KvtierError):
    """A bug in the daemon or the client; the daemon logs a trace."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KvtierError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        OutOfRange,
        Unavailable,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        Internal,
    )
}


def error_class(code: grpc.StatusCode) -> type[KvtierError]:
    """The ``KvtierError`` subclass for ``code`` (``KvtierError`` itself for other codes)."""
    return _BY_CODE.get(code, KvtierError)


def from_rpc_error(err: grpc.RpcError, address: str) -> KvtierError:
    """The ``KvtierError`` for a failed call to the daemon at ``address``.

    UNAVAILABLE and DEADLINE_EXCEEDED get a message naming ``address``; other
    codes keep the daemon's message as is.
    """
    return from_status(_code_of(err), _details_of(err), address)


def from_status(code: grpc.StatusCode, details: str, address: str) -> KvtierError:
    """The ``KvtierError`` for status ``code`` with the daemon's message ``details``
    (a gRPC call's, or a fast lane error frame's: the same exception either way)."""
    if code is grpc.StatusCode.UNAVAILABLE:
        details = (
            f"cannot reach kvtierd at {address}: the daemon is not running "
            f"or the socket is not accessible ({details or 'no details'})"
        )
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"kvtierd at {address} did not answer within the deadline ({details})"
    return error_class(code)(details, code, address)


def _code_of(err: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(err, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _details_of(err: grpc.RpcError) -> str:
    details = getattr(err, "details", None)
    value = details() if callable(details) else None
    return value if isinstance(value, str) else str(err)
