"""Method handlers guarded against client mistakes that grpc.aio would answer
UNKNOWN and log as an ERROR traceback per call: unparsable requests and calls of
methods the daemon does not implement.

Unparsable requests. grpc.aio deserializes a request before any handler runs; a ``DecodeError``
there is answered ``UNKNOWN "Unexpected DecodeError"`` and logged at ERROR with
a traceback, once per request. ``guard`` wraps a method handler's request
deserializer so that unparsable bytes become an ``UnparsableRequest`` instead,
and the call is answered INVALID_ARGUMENT naming the method and the message
type it expected:

- a servicer that maps ``KvtierdError`` to statuses itself (KVTier, through
  ``service._handle``) keeps its behavior unwrapped: the marker raises
  ``InvalidArgument`` on its first field read, after authorization. Well-formed
  calls pay nothing beyond the ``try`` around parsing;
- any other servicer (health, reflection) gets a behavior wrapper that aborts
  with INVALID_ARGUMENT before the servicer sees the marker.

Unimplemented methods. A method the servicer does not override is the
generated base class's placeholder (sync: it would run in grpc's thread pool
and raise ``NotImplementedError``); it is replaced by an async handler that
answers UNIMPLEMENTED naming the method (health's ``List`` today).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvtierd.errors import InvalidArgument

Deserializer = Callable[[bytes], Any]


class UnparsableRequest:
    """Stands in for a request whose bytes did not parse.

    Invariant: reading any field raises ``InvalidArgument(message)``, so no
    handler can act on it; a handler that reads its request only inside its
    status mapping answers INVALID_ARGUMENT and changes no state.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgument(self.message)

    def __repr__(self) -> str:
        return f"UnparsableRequest({self.message!r})"


def lenient(deserializer: Deserializer, method: str) -> Deserializer:
    """``deserializer`` that returns an ``UnparsableRequest`` instead of raising
    ``DecodeError``; ``method`` is the full method path (``/pkg.Service/Name``)."""
    type_name = _message_type_name(deserializer)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return UnparsableRequest(
                f"{method}: the request is not a valid {type_name} ({_reason(exc)}); "
                f"send a {type_name} encoded from the same .proto as the daemon's"
            )

    return deserialize


def guard(handler: grpc.RpcMethodHandler, method: str, *, maps_errors: bool) -> Any:
    """``handler`` with a lenient request deserializer, or an UNIMPLEMENTED
    answer for a placeholder. ``maps_errors``: the behavior turns
    ``KvtierdError`` into statuses itself (see the module doc); otherwise it is
    wrapped to abort with INVALID_ARGUMENT on a marker. Costs nothing per call
    but the ``try`` around parsing (and, for wrapped behaviors, one type check)."""
    kind = _kind(handler)
    behavior = getattr(handler, kind)
    if _is_placeholder(behavior):
        unimplemented = _unimplemented(method, handler.response_streaming)
        # the request is never read: no deserializer, nothing to parse
        return _replace(handler, request_deserializer=None, **{kind: unimplemented})
    if handler.request_deserializer is None:  # raw bytes: nothing to parse
        return handler
    replaced: dict[str, Any] = {
        "request_deserializer": lenient(handler.request_deserializer, method)
    }
    if not maps_errors:
        replaced[kind] = _rejecting(behavior, handler.request_streaming)
    return _replace(handler, **replaced)


def _replace(handler: grpc.RpcMethodHandler, **fields: Any) -> Any:
    """A copy of ``handler`` (grpc's handlers are named tuples) with ``fields`` replaced."""
    return handler._replace(**fields)  # type: ignore[attr-defined]


def _is_placeholder(behavior: Callable[..., Any]) -> bool:
    """A method a servicer inherits from its generated ``*_pb2_grpc`` base class."""
    function = getattr(behavior, "__func__", behavior)
    return getattr(function, "__module__", "").endswith("_pb2_grpc")


def _unimplemented(method: str, response_streaming: bool) -> Callable[..., Any]:
    message = f"{method} is not implemented by kvtierd"

    if response_streaming:

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
            yield  # pragma: no cover - abort raises

        return generator

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    return coroutine


def _kind(handler: grpc.RpcMethodHandler) -> str:
    requests = "stream" if handler.request_streaming else "unary"
    responses = "stream" if handler.response_streaming else "unary"
    return f"{requests}_{responses}"


async def _abort(context: grpc.aio.ServicerContext, request: UnparsableRequest) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
    async for request in requests:
        if type(request) is UnparsableRequest:
            await _abort(context, request)
        yield request


def _rejecting(behavior: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """``behavior`` behind a check for ``UnparsableRequest``: same calling
    convention (coroutine or async generator), so grpc.aio drives it alike."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request_streaming:
            return _checked(request, context)
        if type(request) is UnparsableRequest:
            await _abort(context, request)
        return request

    if inspect.isasyncgenfunction(behavior):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in behavior(await checked(request, context), context):
                yield response

        return generator
    if inspect.iscoroutinefunction(behavior):

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await checked(request, context), context)

        return coroutine
    raise TypeError(f"{behavior!r}: only async handlers are served (grpc.aio)")


def _message_type_name(deserializer: Deserializer) -> str:
    """``pkg.Message`` for a generated ``Message.FromString``."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request message")


def _reason(exc: DecodeError) -> str:
    """protobuf's reason without its "Error parsing message with type 'X': " prefix."""
    text = str(exc)
    return text.rpartition(": ")[2] or text or "unparsable bytes"
