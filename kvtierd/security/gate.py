"""The authentication gate: a caller without an identity is refused before its
request is read.

grpc.aio picks a call's method handler from the call's method name and
metadata (``GenericRpcHandler.service``), *before* it receives the request
message. A gate is that generic handler for one service on one transport:

- a call whose metadata carries an identity (``admits``) gets the service's
  real handler, which reads and parses the request as usual;
- any other call gets the refusal handler: a client-streaming handler with no
  deserializer that answers UNAUTHENTICATED without ever asking for a message.
  grpc receives a request message only when a handler asks for one, so the
  body of a refused call is never assembled nor parsed: what the daemon holds
  of it is bounded by HTTP/2 flow control (the stream's receive window), not by
  ``grpc.max_receive_message_length``.

Services in ``OPEN_SERVICES`` (health, for probes) stay open, but unread too:
where a transport is gated, a caller without an identity gets ``Check``
answered as for the default request (the daemon's overall status; the
request it sent is never read: a probe sends the default request anyway) and
``Watch`` refused. So no unauthenticated request of any size is ever assembled.

The refusal is audited (``on_refused``: method, peer, message). Per admitted
call a gate costs one dict lookup for the method and the ``admits`` check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})

Admits = Callable[[Sequence[tuple[str, Any]] | None], bool]


class AuthenticationGate(grpc.GenericRpcHandler):
    """Serves ``handlers`` (full method path -> method handler) of one service to
    callers ``admits`` lets through; refuses the others unread."""

    def __init__(
        self,
        handlers: Mapping[str, grpc.RpcMethodHandler],
        admits: Admits,
        message: str,
        on_refused: Callable[[str, str, str], None] | None = None,
        unread_answers: Mapping[str, grpc.RpcMethodHandler] | None = None,
    ) -> None:
        """``unread_answers``: method path -> the handler that answers a caller
        without an identity in place of the refusal (it must not read the request)."""
        self._handlers = dict(handlers)
        self._admits = admits
        self._refusals = {method: _refusal(method, message, on_refused) for method in handlers}
        self._refusals.update(unread_answers or {})

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            return None  # another service's method
        if self._admits(handler_call_details.invocation_metadata):
            return handler
        return self._refusals[method]


def _refusal(
    method: str, message: str, on_refused: Callable[[str, str, str], None] | None
) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request: it is
    client-streaming (grpc hands it an iterator it never advances) and has no
    deserializer. Its answer carries no message, so it suits unary and
    streaming methods alike."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        if on_refused is not None:
            on_refused(method, context.peer(), message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(refuse)


def answer_default_request(
    handler: grpc.RpcMethodHandler, default_request: Callable[[], Any]
) -> grpc.RpcMethodHandler:
    """A handler for a unary method that never reads the caller's request: it runs
    ``handler``'s behavior on ``default_request()`` instead (client-streaming with
    no deserializer, like the refusal; the same response serializer)."""
    behavior: Any = handler.unary_unary  # an async behavior on a grpc.aio server
    if behavior is None:
        raise ValueError("answer_default_request serves unary-unary methods only")

    async def answer(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(default_request(), context)

    return grpc.stream_unary_rpc_method_handler(
        answer, response_serializer=handler.response_serializer
    )
