"""Keys packed into one ``bytes``: how the event log retains them.

The packing is protobuf's wire encoding of a ``repeated bytes`` field numbered 2,
which is ``Event.keys`` in ``kvtier.v1`` (docs/design/protocol.md): for each key
the tag byte ``0x12``, the key's length as a varint, the key. So a retained event
costs its keys' bytes plus two or three bytes a key, one Python object for all of
them (not one per key: a 256-byte key as a ``bytes`` object takes 304 bytes of
the heap, and a tuple slot more), and a reader hands the packed bytes to
protobuf as they are (``Message.MergeFromString``) without a Python object per key.

Pure functions; no protobuf import (this package sits below the wire layer).
"""

from __future__ import annotations

from collections.abc import Sequence

_TAG = b"\x12"  # field 2, wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# the tag and length of keys up to 256 bytes (the protocol's limit), precomputed
_PREFIX = [_TAG + _varint(n) for n in range(257)]


def _prefix(length: int) -> bytes:
    return _PREFIX[length] if length < len(_PREFIX) else _TAG + _varint(length)


def packed_size(key_length: int) -> int:
    """Bytes one key of ``key_length`` bytes takes packed."""
    return len(_prefix(key_length)) + key_length


_PACKED_SIZE = [packed_size(n) for n in range(len(_PREFIX))]


def packed_sizes(keys: Sequence[bytes]) -> list[int]:
    """``packed_size`` of each key, in order (C-level for keys up to 256 bytes)."""
    try:
        return list(map(_PACKED_SIZE.__getitem__, map(len, keys)))
    except IndexError:
        return [packed_size(len(key)) for key in keys]


def pack(keys: Sequence[bytes]) -> bytes:
    """``keys`` in order, packed. Keys of one length (the usual case: an engine's
    hashes) take one C-level ``join``; mixed lengths a prefix per key."""
    if not keys:
        return b""
    lengths = set(map(len, keys))
    if len(lengths) == 1:
        separator = _prefix(lengths.pop())
        return separator + separator.join(keys)
    return b"".join([_prefix(len(key)) + key for key in keys])


def unpack(packed: bytes) -> tuple[bytes, ...]:
    """The keys :func:`pack` packed, in order. Raises ValueError on bytes it did
    not make (a wrong tag, a length running past the end)."""
    keys: list[bytes] = []
    view = memoryview(packed)
    at, end = 0, len(packed)
    while at < end:
        if packed[at] != _TAG[0]:
            raise ValueError(f"not packed keys: byte {at} is {packed[at]:#x}, not the tag")
        at, length = _read_varint(packed, at + 1)
        if at + length > end:
            raise ValueError(f"not packed keys: a key of {length} bytes runs past the end")
        keys.append(bytes(view[at : at + length]))
        at += length
    return tuple(keys)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data):
            raise ValueError("not packed keys: a length runs past the end")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return at, value
        shift += 7
