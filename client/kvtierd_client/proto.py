"""Deprecated alias of :mod:`kvtierd_client.wire.proto`, the public import path of the
raw ``kvtier.v1`` stubs (``pb2``, ``pb2_grpc``) since the client's modules were grouped
by layer.

Code written against the earlier layout (``from kvtierd_client.proto import pb2``)
keeps working: it gets the very same module objects, with a DeprecationWarning
naming the new path, raised when ``pb2`` or ``pb2_grpc`` is taken from here (PEP 562:
the warning points at the line that took it). Nothing in kvtierd imports this module.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from kvtierd_client.wire import proto as _proto

if TYPE_CHECKING:  # type checkers see the real modules
    from kvtierd_client.wire.proto import pb2, pb2_grpc

__all__ = ["pb2", "pb2_grpc"]

MOVED = "kvtierd_client.proto is deprecated: import pb2 and pb2_grpc from kvtierd_client.wire.proto"


def __getattr__(name: str) -> Any:
    if name in __all__:
        warnings.warn(MOVED, DeprecationWarning, stacklevel=2)
        return getattr(_proto, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
