"""The block format every tier that keeps blocks outside the daemon writes
(docs/design/formats.md): a :data:`HEADER_SIZE`-byte header, then the payload (one
primary row). An fs tier's block file (:mod:`kvtierd.tiers.fs.fsformat` names and
places it) and a redis tier's value are exactly this; the header size is one page,
so the payload is page-aligned and both can be moved with ``O_DIRECT``.

A block belongs to one pool: its header carries the pool's fingerprint
(:class:`PoolIdentity`: name, block size and layout), so blocks of pools whose bytes
mean different things are never taken for each other.

Two header versions:

* :data:`FORMAT_VERSION` (1), *unkeyed*: key, pool fingerprint, payload length,
  the payload's xxh3-64 and the header's own xxh3-64. It detects accidents (a
  torn, truncated, mixed-up or stale value), not a writer who means harm.
* :data:`KEYED_VERSION` (2), written by a tier with ``integrity_key_file``: the
  same fields, then the id of the key and a MAC (keyed BLAKE3,
  :mod:`kvtierd.tiers.integrity`) over the header's bytes before it and the
  payload; the header's checksum covers the MAC too.

Which one a tier accepts (:func:`check_payload`, :func:`check_sealing`): a tier
without keys reads version 1 only; a tier with keys reads version 2 sealed
under one of its keys only, so a version 1 value (written without the key) is
refused with :class:`IntegrityRefused` like a forged one.

Pure: no I/O; may import only :mod:`kvtierd.tiers.failures` and
:mod:`kvtierd.tiers.integrity` of the tiers.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtierd.tiers.failures import BlockRefused
from kvtierd.tiers.integrity import KEY_ID_BYTES, MAC_BYTES, KeyRing, mac

MAGIC = b"KVTB"
FORMAT_VERSION = 1  # unkeyed: xxh3 checksums only
KEYED_VERSION = 2  # xxh3 checksums and a MAC under an integrity key
HEADER_SIZE = 4096  # one page: the payload starts page-aligned (O_DIRECT)
MAX_KEY_BYTES = 256
FINGERPRINT_BYTES = 16

# magic, version, header length, payload length, fingerprint, key length, key, payload xxh3
_FIELDS = struct.Struct(f"<4sHIQ{FINGERPRINT_BYTES}sH{MAX_KEY_BYTES}sQ")
_KEY_ID = struct.Struct(f"<{KEY_ID_BYTES}s")  # version 2: after _FIELDS, covered by the MAC
_MAC = struct.Struct(f"<{MAC_BYTES}s")  # version 2: after the key id
_SIGNED = _FIELDS.size + _KEY_ID.size  # version 2: the header bytes the MAC covers
_CHECKSUM = struct.Struct("<Q")
HEADER_USED = _FIELDS.size + _CHECKSUM.size  # bytes of a version 1 header that carry data
KEYED_HEADER_USED = _SIGNED + _MAC.size + _CHECKSUM.size  # the same, version 2


class CorruptBlock(BlockRefused):
    """A block's header or payload does not verify; ``reason`` says why.
    ``integrity``: it failed the keyed check (:class:`IntegrityRefused`)."""

    integrity = False

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class IntegrityRefused(CorruptBlock):
    """The value is not sealed under one of the tier's keys: written without a key
    (version 1) when the tier has keys, sealed when it has none, sealed under a key
    the tier does not hold, or its MAC does not verify (forged or damaged)."""

    integrity = True


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, self-consistent block header (its own checksum verified)."""

    version: int
    header_length: int
    payload_length: int
    fingerprint: bytes
    key: bytes
    payload_checksum: int
    key_id: bytes | None = None  # version 2: the id of the key that sealed it
    mac: bytes | None = None  # version 2


@dataclass(frozen=True, slots=True)
class PoolIdentity:
    """What makes a pool's blocks compatible: name, block size, layout."""

    pool_name: str
    block_bytes: int
    layout: Any  # JSON-serialisable description of the row layout

    @property
    def digest(self) -> bytes:
        canonical = json.dumps(
            [self.pool_name, self.block_bytes, self.layout], sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).digest()

    @property
    def fingerprint(self) -> bytes:
        """The 16 bytes every block header of this pool carries."""
        return self.digest[:FINGERPRINT_BYTES]


def check_key(key: bytes) -> None:
    """Raises ValueError for keys the format cannot hold."""
    if not isinstance(key, bytes):
        raise ValueError(f"block keys must be bytes, got {type(key).__name__}")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"block key of {len(key)} bytes exceeds the {MAX_KEY_BYTES}-byte limit")


def encode_header(
    *, key: bytes, fingerprint: bytes, payload_length: int, payload_checksum: int
) -> bytes:
    """The :data:`HEADER_SIZE`-byte version 1 (unkeyed) header of a block (zero
    padded)."""
    fields = _fields(FORMAT_VERSION, key, fingerprint, payload_length, payload_checksum)
    checksum = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
    return (fields + checksum).ljust(HEADER_SIZE, b"\0")


def seal_header(
    *, key: bytes, fingerprint: bytes, payload: bytes | bytearray | memoryview, keys: KeyRing
) -> bytes:
    """The version 2 header of ``key``'s block of ``payload``, sealed with
    ``keys.sealing``: the fields, the key id, the MAC over both and ``payload``,
    the header checksum over all of it."""
    signed = _fields(
        KEYED_VERSION, key, fingerprint, len(payload), payload_checksum(payload)
    ) + _KEY_ID.pack(keys.sealing.key_id)
    fields = signed + _MAC.pack(mac(keys.sealing.secret, signed, payload))
    checksum = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
    return (fields + checksum).ljust(HEADER_SIZE, b"\0")


def block_header(
    *, key: bytes, fingerprint: bytes, payload: bytes | bytearray | memoryview,
    keys: KeyRing | None,
) -> bytes:  # fmt: skip
    """The header a tier writes for ``payload``: sealed with its keys, version 1
    without."""
    if keys is None:
        return encode_header(
            key=key,
            fingerprint=fingerprint,
            payload_length=len(payload),
            payload_checksum=payload_checksum(payload),
        )
    return seal_header(key=key, fingerprint=fingerprint, payload=payload, keys=keys)


def _fields(
    version: int, key: bytes, fingerprint: bytes, payload_length: int, payload_xxh: int
) -> bytes:
    check_key(key)
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return _FIELDS.pack(
        MAGIC, version, HEADER_SIZE, payload_length, fingerprint, len(key), key, payload_xxh
    )


def decode_header(buf: bytes | bytearray | memoryview | mmap.mmap) -> Header:
    """Decodes and self-verifies a header; CorruptBlock(reason) on any mismatch.

    Checks: length, magic, version, header checksum, header length, key length.
    Pool-specific checks (fingerprint, key, payload size) are the caller's.
    """
    if len(buf) < HEADER_USED:
        raise CorruptBlock(f"header truncated ({len(buf)} of {HEADER_SIZE} bytes)")
    magic, version = struct.unpack_from("<4sH", buf)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version not in (FORMAT_VERSION, KEYED_VERSION):
        raise CorruptBlock(f"unsupported format version {version}")
    used = _FIELDS.size if version == FORMAT_VERSION else _SIGNED + _MAC.size
    if len(buf) < used + _CHECKSUM.size:
        raise CorruptBlock(f"header truncated ({len(buf)} of {HEADER_SIZE} bytes)")
    fields = bytes(buf[:used])
    (stored,) = _CHECKSUM.unpack_from(buf, used)
    if stored != xxhash.xxh3_64_intdigest(fields):
        raise CorruptBlock("header checksum mismatch")
    _, _, header_len, payload_len, fingerprint, key_len, key_field, payload_xxh = (
        _FIELDS.unpack_from(fields)
    )
    if header_len != HEADER_SIZE:
        raise CorruptBlock(f"header length {header_len} != {HEADER_SIZE}")
    if key_len > MAX_KEY_BYTES:
        raise CorruptBlock(f"key length {key_len} > {MAX_KEY_BYTES}")
    return Header(
        version=version,
        header_length=header_len,
        payload_length=payload_len,
        fingerprint=fingerprint,
        key=key_field[:key_len],
        payload_checksum=payload_xxh,
        key_id=_KEY_ID.unpack_from(fields, _FIELDS.size)[0] if version == KEYED_VERSION else None,
        mac=_MAC.unpack_from(fields, _SIGNED)[0] if version == KEYED_VERSION else None,
    )


def verify_header(
    header: Header, *, key: bytes | None, fingerprint: bytes, block_bytes: int
) -> None:
    """Pool-level checks of a decoded header; CorruptBlock on mismatch.

    ``key=None`` skips the key check (used when scanning, where the key comes
    from the header; the caller then checks it against the file name).
    """
    if header.fingerprint != fingerprint:
        raise CorruptBlock(f"pool fingerprint {header.fingerprint.hex()} != {fingerprint.hex()}")
    if header.payload_length != block_bytes:
        raise CorruptBlock(f"payload length {header.payload_length} != block size {block_bytes}")
    if key is not None and header.key != key:
        raise CorruptBlock(f"header names key {header.key.hex()}, expected {key.hex()}")


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a payload (releases the GIL on large buffers)."""
    return xxhash.xxh3_64_intdigest(payload)


def check_sealing(header: Header, keys: KeyRing | None) -> None:
    """The part of the keyed check a header alone allows: IntegrityRefused unless
    ``header`` is of the version the tier reads and, sealed, under one of its key
    ids. (The start-up scan and a shared root's checks read headers only; the MAC
    is checked at every load, :func:`check_payload`.)"""
    if keys is None:
        if header.key_id is not None:
            raise IntegrityRefused(
                f"sealed with integrity key {header.key_id.hex()}; this tier has no "
                "integrity_key_file"
            )
        return
    if header.key_id is None:
        raise IntegrityRefused("no MAC: written without an integrity key")
    if keys.find(header.key_id) is None:
        raise IntegrityRefused(
            f"sealed with integrity key {header.key_id.hex()}, not this tier's ({keys.ids()})"
        )


def check_payload(
    head: bytes | bytearray | memoryview | mmap.mmap,
    header: Header,
    payload: bytes | bytearray | memoryview,
    keys: KeyRing | None,
) -> None:
    """Verifies ``payload`` against its decoded ``header`` (``head``: the header's
    bytes): without keys the xxh3 checksum of a version 1 header; with keys the MAC
    of a version 2 header under the key it names (the xxh3 is then redundant and
    skipped). CorruptBlock or IntegrityRefused on any mismatch."""
    check_sealing(header, keys)
    if keys is None or header.key_id is None:
        if payload_checksum(payload) != header.payload_checksum:
            raise CorruptBlock("payload checksum mismatch")
        return
    key = keys.find(header.key_id)  # found: check_sealing passed
    if key is None or mac(key.secret, memoryview(head)[:_SIGNED], payload) != header.mac:
        raise IntegrityRefused(
            f"MAC mismatch under integrity key {header.key_id.hex()}: forged or damaged"
        )
