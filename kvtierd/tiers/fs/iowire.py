"""The protocol between the daemon and its fs-tier I/O workers (:mod:`.ioworker`).

Owns the framing and the vocabulary both sides speak; nothing else. Used by the
worker process (:mod:`.ioworker`) and by the daemon's side (:mod:`.blockio`).

Invariants:

* A message is one ``marshal``-ed tuple or list of builtins, prefixed with its
  length (4 bytes, little-endian) on a Unix stream socket; nothing is unpickled.
* A request is ``(op, region, params, items)``: ``op`` is :data:`WRITE` or
  :data:`READ`, ``region`` a :data:`RegionRef`, ``params`` the request's
  parameters (the pool directory last), ``items`` one tuple per block.
* A reply is a list with one :data:`Reply` per item, in order: None (done) or
  an error tuple made by :func:`encode_error` and rebuilt by :func:`error_of`.
"""

from __future__ import annotations

import errno
import marshal
import socket
import struct
import time
from typing import Any

from kvtierd.tiers.fs.blockfile import CorruptFile

_LENGTH = struct.Struct("<I")

# A region as a worker sees it: (path, st_dev, st_ino, block_bytes).
RegionRef = tuple[str, int, int, int]
# One block's outcome: None (done), or an error tuple (see encode_error / error_of).
Reply = tuple[Any, ...] | None

WRITE = "w"
READ = "r"
READY = ("ready",)  # a worker's first message on each channel, once it has started


def send_message(sock: socket.socket, obj: tuple[Any, ...] | list[Any]) -> None:
    data = marshal.dumps(obj)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_message(sock: socket.socket, deadline: float | None = None) -> Any:
    """The next message; EOFError when the peer closed the socket between messages.
    ``deadline`` (monotonic): TimeoutError once it passes without the whole message
    (the socket's timeout is set before each read)."""
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size, True, deadline))
    return marshal.loads(_receive_exactly(sock, length, False, deadline))


def _receive_exactly(
    sock: socket.socket, n: int, at_boundary: bool, deadline: float | None
) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            if at_boundary and got == 0:
                raise EOFError
            raise ConnectionError("socket closed in the middle of a message")
        got += k
    return bytes(buf)


def encode_error(exc: BaseException) -> tuple[Any, ...]:
    """An exception as a reply tuple (rebuilt by :func:`error_of` in the daemon)."""
    if isinstance(exc, CorruptFile):
        dev, ino = exc.identity if exc.identity is not None else (-1, -1)
        return ("corrupt", exc.reason, dev, ino, exc.kind, exc.integrity)
    if isinstance(exc, OSError):
        return ("os", exc.errno or 0, exc.strerror or str(exc), exc.filename)
    return ("error", f"{type(exc).__name__}: {exc}")


def error_of(reply: Reply) -> BaseException | None:
    """The exception a block's reply stands for (None: the block is done)."""
    if reply is None:
        return None
    kind = reply[0]
    if kind == "corrupt":
        _, reason, dev, ino, what, integrity = reply
        return CorruptFile(reason, None if ino == -1 else (dev, ino), what, integrity)
    if kind == "os":
        _, code, message, filename = reply
        if code == errno.ENOENT:
            return FileNotFoundError(code, message, filename)
        return OSError(code, message, filename)
    return RuntimeError(f"block I/O: {reply[1]}")
