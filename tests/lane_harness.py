"""Raw fast-lane connections for the integration tests: open a session over gRPC, connect
its lane, bind, and read and write frames by hand (no client library), as an attacker or
a broken client would."""

from __future__ import annotations

import socket

from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS, frame
from kvtierd_client.wire.proto import pb2


def open_raw(stub, pool: str) -> tuple[pb2.OpenSessionResponse, socket.socket]:
    """A session opened over gRPC and a raw lane connection, not bound yet."""
    response = stub.OpenSession(
        pb2.OpenSessionRequest(pool=pb2.PoolSpec(name=pool, block_bytes=4096, num_blocks=64))
    )
    assert response.fast_lane_path.endswith(".lane") and len(response.fast_lane_token) == 32
    lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lane.settimeout(30)
    lane.connect(response.fast_lane_path)
    return response, lane


def read_frame(lane: socket.socket) -> tuple[int, bytes] | None:
    """The next frame, or None at the end of the stream."""
    header = _read_exactly(lane, HEADER.size)
    if header is None:
        return None
    length, kind = HEADER.unpack(header)
    body = _read_exactly(lane, length - 1)
    assert body is not None, "stream ended inside a frame"
    return kind, body


def _read_exactly(lane: socket.socket, count: int) -> bytes | None:
    data = b""
    while len(data) < count:
        try:
            chunk = lane.recv(count - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def bound_raw(stub, pool: str) -> tuple[pb2.OpenSessionResponse, socket.socket]:
    response, lane = open_raw(stub, pool)
    lane.sendall(frame(BIND, response.fast_lane_token))
    assert read_frame(lane) == (0, b"")
    return response, lane


def call_frame(name: str, request) -> bytes:
    return frame(METHODS[name][0], request.SerializeToString())
