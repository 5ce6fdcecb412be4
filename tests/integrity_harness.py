"""Integrity keys and forged values for the keyed-integrity tests of the shared tiers
(redis values and shared fs block files are one format: kvtierd.tiers.blockformat).

``write_key`` makes a key file as an operator would (32 random bytes, mode 0600);
``forged`` builds what a writer of the server or the root can make without the
fleet's key: a valid unkeyed header over bytes of its choosing, or a header sealed
under a key of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine_harness import BLOCK

from kvtierd.tiers import blockformat
from kvtierd.tiers.integrity import KEY_BYTES, IntegrityKey, KeyRing


def write_key(path: Path, secret: bytes | None = None) -> Path:
    """A key file at ``path``: ``secret`` (default 32 random bytes), mode 0600."""
    path.write_bytes(os.urandom(KEY_BYTES) if secret is None else secret)
    path.chmod(0o600)
    return path


def key_id(path: Path) -> bytes:
    """The id of the key in the key file ``path``."""
    return IntegrityKey.of(path.read_bytes()).key_id


def forged(key: bytes, pool: str, data: bytes, sealed_with: bytes | None = None) -> bytes:
    """A whole value (header + ``data``) for ``key`` of ``pool``: an unkeyed (version 1)
    header with valid checksums, or one sealed under the secret ``sealed_with``."""
    fingerprint = blockformat.PoolIdentity(pool, BLOCK, "L").fingerprint
    keys = None
    if sealed_with is not None:
        own = IntegrityKey.of(sealed_with)
        keys = KeyRing(own, (own,))
    header = blockformat.block_header(key=key, fingerprint=fingerprint, payload=data, keys=keys)
    return header + data


def header_of(value: bytes) -> blockformat.Header:
    return blockformat.decode_header(value[: blockformat.HEADER_SIZE])
