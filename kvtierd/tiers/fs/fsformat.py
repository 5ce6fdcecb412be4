"""On-disk format of the FS tier (docs/design/formats.md): block files and ``pool.json``.

Layout::

    <root>/<pool-dir>/pool.json
    <root>/<pool-dir>/<hh>/<hh>/<name>.kvb

* ``<pool-dir>`` = pool name with chars outside ``[A-Za-z0-9._-]`` as ``_`` (at
  most 64) + ``-`` + the first 16 hex of the pool fingerprint digest, so pools
  whose block size or layout differ never share files.
* ``<name>`` = hex of the key, or sha256 hex of the key for keys longer than
  :data:`LONG_KEY_BYTES` (the full key is in the header either way); ``<hh>/<hh>``
  are the first four hex chars of ``<name>`` (padded with ``0``).

A block file is a :data:`HEADER_SIZE`-byte header followed by the payload (one
primary row). The header size is one page, so the payload is page-aligned and
both can be moved with ``O_DIRECT``. Files are immutable once renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

MAGIC = b"KVTB"
FORMAT_VERSION = 1
HEADER_SIZE = 4096  # one page: the payload starts page-aligned (O_DIRECT)
MAX_KEY_BYTES = 256
LONG_KEY_BYTES = 120  # longer keys are named by their sha256
FINGERPRINT_BYTES = 16
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
POOL_FILE = "pool.json"
POOL_FILE_FORMAT = "kvtierd-fs-pool"
POOL_FILE_MAX_BYTES = 64 << 10  # a pool.json larger than this is not a pool description

_POOL_NAME_LIMIT = 64
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")

# magic, version, header length, payload length, fingerprint, key length, key, payload xxh3
_FIELDS = struct.Struct(f"<4sHIQ{FINGERPRINT_BYTES}sH{MAX_KEY_BYTES}sQ")
_CHECKSUM = struct.Struct("<Q")
HEADER_USED = _FIELDS.size + _CHECKSUM.size  # bytes of the header that carry data


class CorruptBlock(Exception):
    """A block file's header or payload does not verify; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, self-consistent block header (its own checksum verified)."""

    version: int
    header_length: int
    payload_length: int
    fingerprint: bytes
    key: bytes
    payload_checksum: int


@dataclass(frozen=True, slots=True)
class PoolIdentity:
    """What makes a pool's files compatible: name, block size, layout."""

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

    @property
    def dir_name(self) -> str:
        safe = _UNSAFE_CHARS.sub("_", self.pool_name)[:_POOL_NAME_LIMIT]
        return f"{safe}-{self.digest.hex()[:16]}"

    def describe(self) -> dict[str, Any]:
        """The contents of ``pool.json``."""
        return {
            "format": POOL_FILE_FORMAT,
            "format_version": FORMAT_VERSION,
            "pool_name": self.pool_name,
            "block_bytes": self.block_bytes,
            "layout": self.layout,
            "fingerprint": self.fingerprint.hex(),
        }


def block_file_name(key: bytes) -> str:
    """``<name>.kvb`` for ``key`` (hex, or sha256 hex for keys over 120 bytes)."""
    if len(key) > LONG_KEY_BYTES:
        return hashlib.sha256(key).hexdigest() + BLOCK_SUFFIX
    return key.hex() + BLOCK_SUFFIX


def block_rel_path(key: bytes) -> str:
    """The block file of ``key`` relative to its pool directory: ``hh/hh/<name>.kvb``."""
    name = block_file_name(key)
    fan = (name[: -len(BLOCK_SUFFIX)] + "0000")[:4]
    return f"{fan[:2]}/{fan[2:]}/{name}"


def check_key(key: bytes) -> None:
    """Raises ValueError for keys the format cannot hold."""
    if not isinstance(key, bytes):
        raise ValueError(f"block keys must be bytes, got {type(key).__name__}")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"block key of {len(key)} bytes exceeds the {MAX_KEY_BYTES}-byte limit")


def encode_header(
    *, key: bytes, fingerprint: bytes, payload_length: int, payload_checksum: int
) -> bytes:
    """The :data:`HEADER_SIZE`-byte header of a block file (zero padded)."""
    check_key(key)
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        payload_length,
        fingerprint,
        len(key),
        key,
        payload_checksum,
    )
    checksum = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
    return (fields + checksum).ljust(HEADER_SIZE, b"\0")


def decode_header(buf: bytes | bytearray | memoryview | mmap.mmap) -> Header:
    """Decodes and self-verifies a header; CorruptBlock(reason) on any mismatch.

    Checks: length, magic, version, header checksum, header length, key length.
    Pool-specific checks (fingerprint, key, payload size) are the caller's.
    """
    if len(buf) < HEADER_USED:
        raise CorruptBlock(f"header truncated ({len(buf)} of {HEADER_SIZE} bytes)")
    fields = bytes(buf[: _FIELDS.size])
    magic, version, header_len, payload_len, fingerprint, key_len, key_field, payload_xxh = (
        _FIELDS.unpack(fields)
    )
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"unsupported format version {version}")
    (stored,) = _CHECKSUM.unpack_from(buf, _FIELDS.size)
    if stored != xxhash.xxh3_64_intdigest(fields):
        raise CorruptBlock("header checksum mismatch")
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
