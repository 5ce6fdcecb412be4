"""Where the FS tier keeps its blocks (docs/design/formats.md): the names and places
of block files, and ``pool.json``.

Layout::

    <root>/<pool-dir>/pool.json
    <root>/<pool-dir>/<hh>/<hh>/<name>.kvb

* ``<pool-dir>`` = pool name with chars outside ``[A-Za-z0-9._-]`` as ``_`` (at
  most 64) + ``-`` + the first 16 hex of the pool fingerprint digest, so pools
  whose block size or layout differ never share files (:func:`pool_dir_name`).
* ``<name>`` = hex of the key, or sha256 hex of the key for keys longer than
  :data:`LONG_KEY_BYTES` (the full key is in the header either way); ``<hh>/<hh>``
  are the first four hex chars of ``<name>`` (padded with ``0``).

A block file is one block of :mod:`kvtierd.tiers.blockformat` (header, then the
payload), as a redis tier's value is. Files are immutable once renamed into place.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kvtierd.tiers.blockformat import FORMAT_VERSION, PoolIdentity

LONG_KEY_BYTES = 120  # longer keys are named by their sha256
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
POOL_FILE = "pool.json"
POOL_FILE_FORMAT = "kvtierd-fs-pool"
POOL_FILE_MAX_BYTES = 64 << 10  # a pool.json larger than this is not a pool description

_POOL_NAME_LIMIT = 64
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def pool_dir_name(identity: PoolIdentity) -> str:
    """The pool directory of ``identity`` below the root: ``<pool>-<fingerprint16>``."""
    safe = _UNSAFE_CHARS.sub("_", identity.pool_name)[:_POOL_NAME_LIMIT]
    return f"{safe}-{identity.digest.hex()[:16]}"


def pool_file(identity: PoolIdentity) -> dict[str, Any]:
    """The contents of ``pool.json``."""
    return {
        "format": POOL_FILE_FORMAT,
        "format_version": FORMAT_VERSION,
        "pool_name": identity.pool_name,
        "block_bytes": identity.block_bytes,
        "layout": identity.layout,
        "fingerprint": identity.fingerprint.hex(),
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
