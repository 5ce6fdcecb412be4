"""The fast lane's framing, shared by the daemon (``kvtierd.api.fastlane``) and the
clients (``kvtierd_client._rpc.fastlane``). No I/O here.

A lane is one Unix stream connection bound to one session. Every frame is::

    [u32 length, little-endian][u8 kind][length - 1 bytes of body]

``length`` counts the kind byte and the body, so it is never 0. Client to
daemon, ``kind`` is a method (``METHODS``) and the body its protobuf request,
the very message gRPC carries; the first frame of a connection must be
``BIND`` with the session's ``fast_lane_token`` as its body. Daemon to client,
``kind`` is a gRPC status code number: ``OK`` (0) with the protobuf response as
the body, or the error's code with its UTF-8 message (the same code and message
the gRPC path answers). Answers come in the order of the requests: there is no
call id. A frame the daemon cannot take (unknown kind, length 0 or over
``fast_lane_max_frame_bytes``, a request before ``BIND``) is answered with an
error frame and the connection is closed.
"""

from __future__ import annotations

import struct
from typing import Any

from kvtierd_client.wire.proto import pb2

__all__ = [
    "BIND",
    "HEADER",
    "LANE_METHODS",
    "METHODS",
    "OK",
    "VERSION",
    "frame",
]

VERSION = 1
"""The framing version this module speaks (``OpenSessionResponse.fast_lane_version``)."""

HEADER = struct.Struct("<IB")  # length (kind + body), kind
OK = 0  # grpc.StatusCode.OK's number
BIND = 0  # client -> daemon: the first frame, body = the session's fast_lane_token

# method name -> (kind byte, request type, response type); the kinds are the wire contract
METHODS: dict[str, tuple[int, Any, Any]] = {
    "Lookup": (1, pb2.LookupRequest, pb2.LookupResponse),
    "Touch": (2, pb2.TouchRequest, pb2.TouchResponse),
    "PrepareLoad": (3, pb2.PrepareLoadRequest, pb2.PrepareLoadResponse),
    "CompleteLoad": (4, pb2.CompleteLoadRequest, pb2.CompleteLoadResponse),
    "PrepareStore": (5, pb2.PrepareStoreRequest, pb2.PrepareStoreResponse),
    "CompleteStore": (6, pb2.CompleteStoreRequest, pb2.CompleteStoreResponse),
    "Batch": (7, pb2.BatchRequest, pb2.BatchResponse),
    "KeepAlive": (8, pb2.KeepAliveRequest, pb2.KeepAliveResponse),
}
LANE_METHODS = frozenset(METHODS)
"""The RPCs a session sends over its lane when it has one (every other RPC: gRPC)."""


def frame(kind: int, body: bytes) -> bytes:
    """One frame: header and body (one buffer, so one ``send``)."""
    return HEADER.pack(len(body) + 1, kind) + body
